"""Supervised warm-up: bring a from-scratch model to the edge of competence before RL.

RL from a model that never answers correctly learns nothing (every group's rewards agree), and RL
from a model that already solves the task has nothing to learn. The warm-up trains on the task's
worked solutions (loss on completion tokens only) and stops once *sampled* (T=1) dev accuracy
reaches a target: greedy accuracy is a misleading stopping signal (greedy is far ahead of what
sampled rollouts see).

The result is cached under a key of everything that shapes it, so later runs reuse it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab.evaluation import evaluate
from grpo_lab.learner.batch import collate, encode_prompt, encode_target
from grpo_lab.learner.trainable import TrainableModel
from grpo_lab.progress import CountedProgress, say
from grpo_lab.rollout.hf_engine import HFEngine
from grpo_lab.schema import as_dict


def shared_weights_engine(model, tokenizer):
    """An engine generating with `model` itself (no copy), so every evaluation sees the current weights
    (only the transformers engine can share a live torch module)."""
    return HFEngine(model, tokenizer)


@dataclass
class SFTProgress:
    """Where an SFT loop stands after a step (what `on_step` callbacks see)."""

    step: int              # optimizer steps taken
    loss: float            # this step's loss
    step_time_s: float     # wall time of this step (batch sampling, forward, backward, update)
    trained_s: float       # sum of step_time_s so far: training time, evaluation excluded
    samples: int           # supervised examples seen


def sft_loop(trainable: TrainableModel, tokenizer, items: list, *, batch_size: int, seed: int, device,
             max_steps: int | None = None, max_train_s: float | None = None,
             on_step: Callable[[SFTProgress], bool | None] | None = None,
             extra: Sequence[tuple[list[int], list[int]]] = ()) -> SFTProgress:
    """Supervised training of `trainable` (grpo_lab.learner.trainable: its optimizer takes the steps) on
    `items`' worked solutions (the warm-up, the matched-compute SFT control, a second model's SFT), and on
    `extra` ready-made (prompt ids, target ids) examples drawn from the same pool (the warm-up's revision
    demonstrations, grpo_lab.interaction.demos).

    Batches of `batch_size` items are drawn with replacement from a generator seeded with `seed`.
    Stopping rule: after `max_steps` steps, or once `max_train_s` seconds were spent in steps
    (evaluation excluded), or when `on_step` returns True (e.g. a periodic evaluation reached its
    target); `on_step` runs after every step, outside the timed part, so evaluating there costs no budget.
    Returns the progress after the last step."""
    if max_steps is None and max_train_s is None:
        raise ValueError("sft_loop needs a stopping rule: max_steps and/or max_train_s")
    prompts = [encode_prompt(tokenizer, it.prompt) for it in items] + [p for p, _ in extra]
    targets = [encode_target(tokenizer, it.solution) for it in items] + [t for _, t in extra]
    gen = torch.Generator().manual_seed(seed)
    state = SFTProgress(step=0, loss=float("nan"), step_time_s=0.0, trained_s=0.0, samples=0)
    while ((max_steps is None or state.step < max_steps)
           and (max_train_s is None or state.trained_s < max_train_s)):
        trainable.model.train()   # an evaluation in on_step may have left the model in eval mode
        t0 = time.time()
        idx = torch.randint(len(prompts), (batch_size,), generator=gen).tolist()
        batch = collate([prompts[i] for i in idx], [targets[i] for i in idx], tokenizer.pad_token_id).to(device)
        loss = trainable.sft_step(batch)
        dt = time.time() - t0
        state = SFTProgress(state.step + 1, loss, dt, state.trained_s + dt, state.samples + batch_size)
        if on_step is not None and on_step(state):
            break
    return state


def warmup_sft(base_dir: Path, out_dir: Path, task, cfg, *, max_new_tokens: int, seed: int,
               device: torch.device, demos: Sequence[tuple[list[int], list[int]]] = (),
               replay_steps: int | None = None) -> dict:
    """Train `base_dir`'s model on task.splits['train'] solutions (and `demos`, extra (prompt ids,
    target ids) examples); save to `out_dir`; return stats, with the weights' `digest`. `replay_steps`:
    train exactly that many steps instead of stopping at the sampled-accuracy target (a recorded warm-up
    replayed; warmup.replay_steps).

    Parallel jobs (joblib, Slurm) asking for the same entry wait on a file lock: one builds it,
    the others then read it from the cache."""
    done = out_dir / "warmup.json"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f"{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cfg.cache and done.exists():
            stats = json.loads(done.read_text())
            # Entries cached before the digest was recorded: computed once, then kept with the entry.
            if "digest" not in stats:
                stats["digest"] = weights_digest(out_dir)
                done.write_text(json.dumps(stats, indent=2))
            return {**stats, "cached": True}
        return _train_warmup(base_dir, out_dir, task, cfg, max_new_tokens=max_new_tokens, seed=seed, device=device,
                             demos=demos, replay_steps=replay_steps)


def warmup_key_settings(cfg) -> dict:
    """The warm-up settings a checkpoint is keyed by: all but replay_steps, which keys only a replayed
    warm-up (so warm-ups cached before it existed keep their keys)."""
    return {k: v for k, v in as_dict(cfg).items() if k != "replay_steps"}


def recorded_warmup_steps(out_dir: Path) -> int | None:
    """The step at which the cached warm-up in `out_dir` stopped (None: no complete entry there)."""
    done = out_dir / "warmup.json"
    return json.loads(done.read_text()).get("steps") if done.exists() else None


def weights_digest(model_dir: Path) -> str:
    """sha256 (16 hex digits) of a saved model's weight files, in name order: which checkpoint a run began
    from, comparable across machines (a table's record keeps it per run)."""
    digest = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")) or sorted(Path(model_dir).glob("*.bin")):
        digest.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _train_warmup(base_dir: Path, out_dir: Path, task, cfg, *, max_new_tokens: int, seed: int,
                  device: torch.device, demos: Sequence[tuple[list[int], list[int]]] = (),
                  replay_steps: int | None = None) -> dict:
    done = out_dir / "warmup.json"
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).to(device)
    engine = shared_weights_engine(model, tokenizer)
    # torch's AdamW default weight decay (0.01), as the warm-up has always trained; no clipping.
    trainable = TrainableModel(model, lr=cfg.lr, weight_decay=0.01)
    dev = task.splits["dev"]
    start, history, acc = time.time(), [], 0.0
    tty = sys.stdout.isatty()
    say(f"warm-up SFT: up to {cfg.max_steps} steps of {cfg.batch_size} worked solutions ({len(task.splits['train'])} "
        f"train items{f' + {len(demos)} demonstration examples' if demos else ''}), sampled dev accuracy on {len(dev)} items every {cfg.eval_every} steps, stopping at "
        + (f"step {replay_steps} (a recorded warm-up replayed)" if replay_steps else f"{cfg.target_sampled_dev_accuracy:.0%}")
        + f"; cached in {out_dir}")
    bar = tqdm(total=cfg.max_steps, desc="warm-up SFT", dynamic_ncols=True, file=sys.stdout, disable=not tty)
    # In a log file (no TTY) the bar is off: a line every ~30 s or 10 % of the steps instead.
    progress = CountedProgress("warm-up SFT", cfg.max_steps)

    def on_step(p: SFTProgress) -> bool:
        nonlocal acc
        bar.update(1)
        if not tty:
            progress.update(p.step, f"loss {p.loss:.3f}")
        if p.step % cfg.eval_every != 0 and p.step not in (cfg.max_steps, replay_steps):
            return False
        with torch.no_grad():
            acc = evaluate(engine, tokenizer, dev, temperature=1.0, max_new_tokens=max_new_tokens,
                           seed=seed + p.step)["eval/accuracy"]
        history.append({"step": p.step, "loss": p.loss, "sampled_dev_accuracy": acc})
        bar.set_postfix(loss=f"{p.loss:.3f}", sampled_dev_acc=f"{acc:.2f}")
        if not tty:
            print(f"warm-up SFT step {p.step} | loss {p.loss:.3f} | sampled dev acc {acc:.2f}", flush=True)
        return p.step >= replay_steps if replay_steps else acc >= cfg.target_sampled_dev_accuracy

    last = sft_loop(trainable, tokenizer, task.splits["train"], batch_size=cfg.batch_size, seed=seed,
                    device=device, max_steps=cfg.max_steps, on_step=on_step, extra=demos)
    bar.close()
    with torch.no_grad():
        greedy = evaluate(engine, tokenizer, dev, max_new_tokens=max_new_tokens, seed=seed)["eval/accuracy"]
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    stats = {"steps": last.step, "sampled_dev_accuracy": acc, "greedy_dev_accuracy": greedy,
             "reached_target": acc >= cfg.target_sampled_dev_accuracy, "wall_time_s": time.time() - start,
             "digest": weights_digest(out_dir), **({"replayed_steps": replay_steps} if replay_steps else {}),
             "history": history}
    done.write_text(json.dumps(stats, indent=2))   # written last: its presence marks a complete cache entry
    return {**stats, "cached": False}
