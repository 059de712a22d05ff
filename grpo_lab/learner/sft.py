"""Supervised warm-up: bring a from-scratch model to the edge of competence before RL.

RL from a model that never answers correctly learns nothing (every group's rewards agree), and RL
from a model that already solves the task has nothing to learn. The warm-up trains on the task's
worked solutions (loss on completion tokens only) and stops once *sampled* (T=1) dev accuracy
reaches a target: the calibration in shared/ENVIRONMENT.md found greedy accuracy a misleading
stopping signal (greedy is far ahead of what sampled rollouts see).

The result is cached under a key of everything that shapes it, so later runs reuse it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab.learner.batch import collate, completion_logits, encode_prompt, encode_target, token_logprobs
from grpo_lab.rewards import is_correct
from grpo_lab.rollout.hf_engine import HFEngine


def cache_key(*parts) -> str:
    blob = json.dumps([OmegaConf.to_container(p, resolve=True) if OmegaConf.is_config(p) else p for p in parts],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sampled_accuracy(engine: HFEngine, tokenizer, items, *, temperature: float, max_new_tokens: int,
                     seed: int) -> float:
    """Accuracy of one completion per item at the given temperature (0 = greedy)."""
    prompts = [encode_prompt(tokenizer, it.prompt) for it in items]
    out = engine.generate(prompts, n=1, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens,
                          seed=seed, logprobs=False)
    return sum(is_correct(text, item) for text, item in zip(out.texts, items)) / max(len(items), 1)


def sft_step(model, optimizer, batch) -> float:
    """One supervised step: mean NLL of the completion tokens (the prompt is context, not target)."""
    logp = token_logprobs(completion_logits(model, batch), batch["completion_ids"])   # [B, T]
    mask = batch["response_mask"]
    loss = -(logp * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def warmup_sft(base_dir: Path, out_dir: Path, task, cfg, *, max_new_tokens: int, seed: int,
               device: torch.device) -> dict:
    """Train `base_dir`'s model on task.splits['train'] solutions; save to `out_dir`; return stats.

    Parallel jobs (joblib, Slurm) asking for the same entry wait on a file lock: one builds it,
    the others then read it from the cache."""
    done = out_dir / "warmup.json"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f"{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cfg.cache and done.exists():
            return {**json.loads(done.read_text()), "cached": True}
        return _train_warmup(base_dir, out_dir, task, cfg, max_new_tokens=max_new_tokens, seed=seed, device=device)


def _train_warmup(base_dir: Path, out_dir: Path, task, cfg, *, max_new_tokens: int, seed: int,
                  device: torch.device) -> dict:
    done = out_dir / "warmup.json"
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).to(device)
    engine = HFEngine(model, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    train, dev = task.splits["train"], task.splits["dev"]
    prompts = [encode_prompt(tokenizer, it.prompt) for it in train]
    targets = [encode_target(tokenizer, it.solution) for it in train]
    gen = torch.Generator().manual_seed(seed)
    start, history, acc, step = time.time(), [], 0.0, 0
    tty = sys.stdout.isatty()
    bar = tqdm(total=cfg.max_steps, desc="warm-up SFT", dynamic_ncols=True, file=sys.stdout, disable=not tty)
    for step in range(1, cfg.max_steps + 1):
        model.train()
        idx = torch.randint(len(train), (cfg.batch_size,), generator=gen).tolist()
        batch = collate([prompts[i] for i in idx], [targets[i] for i in idx], tokenizer.pad_token_id).to(device)
        loss = sft_step(model, optimizer, batch)
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            with torch.no_grad():
                acc = sampled_accuracy(engine, tokenizer, dev, temperature=1.0, max_new_tokens=max_new_tokens,
                                       seed=seed + step)
            history.append({"step": step, "loss": loss, "sampled_dev_accuracy": acc})
            bar.set_postfix(loss=f"{loss:.3f}", sampled_dev_acc=f"{acc:.2f}")
            if not tty:
                print(f"warm-up SFT step {step} | loss {loss:.3f} | sampled dev acc {acc:.2f}", flush=True)
            if acc >= cfg.target_sampled_dev_accuracy:
                break
    bar.close()
    with torch.no_grad():
        greedy = sampled_accuracy(engine, tokenizer, dev, temperature=0.0, max_new_tokens=max_new_tokens, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    stats = {"steps": step, "sampled_dev_accuracy": acc, "greedy_dev_accuracy": greedy,
             "reached_target": acc >= cfg.target_sampled_dev_accuracy, "wall_time_s": time.time() - start,
             "history": history}
    done.write_text(json.dumps(stats, indent=2))   # written last: its presence marks a complete cache entry
    return {**stats, "cached": False}
