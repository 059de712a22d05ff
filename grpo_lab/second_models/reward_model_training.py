"""Training reward models from preferences: the data, the loop with early stopping, the held-out metrics, and
the content-keyed cache that lets a run (reward=reward_model) and `python -m grpo_lab.train_reward_model`
share one trained model.

    preference_metrics(scored) -> {accuracy, margin, ece, length_corr}        pure, on held-out scores
    fit(rm, train, held_out, rm_cfg, *, seed) -> (history, best)             the loop, best held-out kept
    make_preferences(cfg, start) -> (train, held_out, stats)                 a file's, or labelled samples
    build_reward_models(cfg, start) -> ([member dirs], stats)                cached by content

What is followed, and from where:

* The trunk starts from the run's starting policy (the warm-up checkpoint), as InstructGPT starts its reward
  model from the SFT model (arXiv 2203.02155 §3.5) and TRL's / OpenRLHF's examples start from an SFT
  checkpoint; `reward_model.trunk=base|path` choose otherwise.
* One epoch-free loop of shuffled minibatches (a group is one pair or one ranking), held-out evaluation every
  `eval_every` steps and early stopping on held-out pairwise accuracy with `patience` (TRL's RewardTrainer with
  load_best_model_at_end; InstructGPT trains one epoch because more over-fits: the held-out stop does the
  same job without guessing the epoch count). The best evaluation's weights are the ones saved.
* Metrics, held out: pairwise accuracy (every ordered pair of a ranking; a tie counts half), the mean margin
  r_w - r_l, the expected calibration error of sigma(r_w - r_l) as the probability that w is preferred (10
  equal-width bins over both orientations of each pair; a Bradley-Terry model claims exactly this
  probability), and the Pearson correlation of the score with the completion's length in characters (length
  is the best-known exploitable bias of learned reward models, Singhal et al., arXiv 2310.03716).
* An ensemble is `ensemble_size` members on the same data, each from its own seed (head initialisation and
  data order), as Coste et al. (arXiv 2310.02743) train theirs.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from grpo_lab.atomic_dir import write_dir_atomically
from grpo_lab.cache import cache_key
from grpo_lab.schema import ConfigError, as_dict
from grpo_lab.second_models.preference_data import (RankedGroup, groups_from_scores, read_preferences,
                                                    swap_labels)

# Where the trunk comes from (reward_model.trunk).
TRUNKS = ("policy", "base", "path")


# ------------------------------------------------------------------------------------------ metrics (pure)
def preference_metrics(scored: Sequence[tuple[RankedGroup, Sequence[float]]], *, bins: int = 10) -> dict[str, float]:
    """Held-out metrics of scores against rankings: `scored` pairs each group (best first) with its completions'
    scores. accuracy (ties half), margin (mean r_better - r_worse), ece of sigma(r_better - r_worse), and
    length_corr (Pearson r of score vs completion length; 0 when either is constant)."""
    diffs = [s[i] - s[j] for g, s in scored for i in range(len(s)) for j in range(i + 1, len(s))]
    if not diffs:
        raise ValueError("no pairs to evaluate")
    accuracy = sum(1.0 if d > 0 else 0.5 if d == 0 else 0.0 for d in diffs) / len(diffs)
    # Calibration over both orientations: p = sigma(d) with outcome 1, and 1 - p with outcome 0.
    probs = [(1.0 / (1.0 + math.exp(-d)), 1.0) for d in diffs] + [(1.0 / (1.0 + math.exp(d)), 0.0) for d in diffs]
    ece = 0.0
    for b in range(bins):
        inside = [(p, y) for p, y in probs if b / bins <= p < (b + 1) / bins or (b == bins - 1 and p == 1.0)]
        if inside:
            conf = sum(p for p, _ in inside) / len(inside)
            freq = sum(y for _, y in inside) / len(inside)
            ece += len(inside) / len(probs) * abs(conf - freq)
    scores = [x for _, s in scored for x in s]
    lengths = [float(len(c)) for g, _ in scored for c in g.completions]
    return {"accuracy": accuracy, "margin": sum(diffs) / len(diffs), "ece": ece,
            "length_corr": _pearson(scores, lengths)}


def _pearson(x: Sequence[float], y: Sequence[float]) -> float:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else 0.0


def score_groups(rm, groups: Sequence[RankedGroup], *, batch_size: int = 64) -> list[tuple[RankedGroup, list[float]]]:
    """Each group with its completions' scores under `rm` (one batched pass over every completion)."""
    prompts = [g.prompt for g in groups for _ in g.completions]
    texts = [c for g in groups for c in g.completions]
    flat = rm.scores(prompts, texts, batch_size=batch_size)
    out, i = [], 0
    for g in groups:
        out.append((g, flat[i:i + len(g.completions)]))
        i += len(g.completions)
    return out


# ------------------------------------------------------------------------------------------------ the loop
def fit(rm, train: Sequence[RankedGroup], held_out: Sequence[RankedGroup], rm_cfg, *, seed: int,
        log=print) -> tuple[list[dict], dict]:
    """Train `rm` (a RewardModel) on `train` until reward_model.max_steps, or until `patience` held-out
    evaluations pass without a better accuracy; `rm` ends with the best evaluation's weights. Returns the
    history (one dict per evaluation: step, the last train step's metrics, held-out metrics under
    ``held_out/``) and the best evaluation."""
    rng = random.Random(seed)
    order: list[int] = []
    history: list[dict] = []
    best, best_weights, stale = None, None, 0
    started = time.perf_counter()
    for step in range(1, rm_cfg.max_steps + 1):
        if len(order) < rm_cfg.batch_size:   # a fresh shuffle once the rest is less than a batch
            order = list(range(len(train)))
            rng.shuffle(order)
        batch = [train[i] for i in order[:rm_cfg.batch_size]]
        order = order[rm_cfg.batch_size:]
        margins = [g.margin or 0.0 for g in batch] if any(g.margin for g in batch) else None
        metrics = rm.ranking_step([(g.prompt, g.completions) for g in batch], loss=rm_cfg.loss, margins=margins,
                                  micro_batch_size=rm_cfg.micro_batch_size)
        if step % rm_cfg.eval_every and step != rm_cfg.max_steps:
            continue
        held = preference_metrics(score_groups(rm, held_out))
        entry = {"step": step, **metrics, **{f"reward_model/held_out/{k}": v for k, v in held.items()},
                 "reward_model/time_s": time.perf_counter() - started}
        history.append(entry)
        log(f"reward model step {step}: loss {metrics['reward_model/loss']:.4f}, held-out accuracy "
            f"{held['accuracy']:.3f}, margin {held['margin']:.3f}, ece {held['ece']:.3f}")
        if best is None or held["accuracy"] > best["reward_model/held_out/accuracy"]:
            best, best_weights, stale = entry, copy.deepcopy(rm.model.state_dict()), 0
        else:
            stale += 1
            if stale >= rm_cfg.patience:
                break
    rm.model.load_state_dict(best_weights)
    return history, best


# ------------------------------------------------------------------------------------------------ the data
def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_reward_model(cfg, errors: list[str]) -> None:
    """The `reward_model` section's own settings (validated with the rest of the config, before anything loads)."""
    from grpo_lab.algos import RANKING_LOSSES

    rm, data = cfg.reward_model, cfg.reward_model.data

    def need(ok: bool, message: str) -> None:
        if not ok:
            errors.append(message)
    need(rm.trunk in TRUNKS, f"reward_model.trunk={rm.trunk!r} must be one of {', '.join(TRUNKS)}")
    need(rm.trunk != "path" or bool(rm.path), "reward_model.trunk=path needs reward_model.path=<a local HF directory>")
    if rm.trunk == "path" and rm.path:
        need(Path(rm.path).is_dir(), f"reward_model.path={rm.path} is not a directory; point it at a local "
                                     "Hugging Face model directory")
    need(rm.loss in RANKING_LOSSES, f"reward_model.loss={rm.loss!r} is not a ranking loss "
                                    f"({', '.join(RANKING_LOSSES.names())})")
    for key in ("lr", "batch_size", "max_steps", "eval_every", "patience", "ensemble_size"):
        need(getattr(rm, key) > 0, f"reward_model.{key}={getattr(rm, key)} must be > 0")
    need(rm.micro_batch_size is None or rm.micro_batch_size > 0,
         f"reward_model.micro_batch_size={rm.micro_batch_size} must be > 0, or null (the whole batch at once)")
    need(rm.grad_clip >= 0 and rm.weight_decay >= 0 and rm.margin_scale >= 0,
         "reward_model.grad_clip, weight_decay and margin_scale must be >= 0")
    need(rm.refresh_every >= 0 and rm.refresh_pairs > 0 and rm.refresh_steps > 0,
         "reward_model.refresh_every must be >= 0 (0 = frozen), refresh_pairs and refresh_steps > 0")
    if rm.refresh_every > 0:
        learned = "reward_model" in cfg.reward.weights
        need(learned, f"reward_model.refresh_every={rm.refresh_every} refreshes a learned reward the run does not "
                      "use; add reward=reward_model or set reward_model.refresh_every=0")
        need(cfg.trainer.max_staleness == 0,
             "reward_model.refresh_every > 0 needs trainer.max_staleness=0: with sampling ahead, the next batch is "
             "scored while the reward model trains")
        need(cfg.reward.isolation != "process", "reward_model.refresh_every > 0 needs the reward in this process "
                                                "(reward.isolation=auto or thread): a worker process holds its own copy")
        need(cfg.interaction.environment in (None, "none") or cfg.interaction.max_turns == 1,
             "reward_model.refresh_every > 0 is single-turn only (a refresh relabels whole completions)")
        need(cfg.reward.reward_model.dtype == "fp32",
             f"reward_model.refresh_every > 0 trains the scoring models in fp32; set reward.reward_model.dtype=fp32 "
             f"(not {cfg.reward.reward_model.dtype}) or refresh_every=0")
    need(data.source in ("policy_samples", "jsonl"),
         f"reward_model.data.source={data.source!r} must be policy_samples or jsonl")
    need(data.form in ("pairs", "ranked"), f"reward_model.data.form={data.form!r} must be pairs or ranked")
    need(0.0 <= data.label_noise < 0.5, f"reward_model.data.label_noise={data.label_noise} must lie in [0, 0.5)")
    if data.source == "jsonl":
        for key in ("path", "held_out_path"):
            p = getattr(data, key)
            need(key != "path" or bool(p), "reward_model.data.source=jsonl needs reward_model.data.path=<file.jsonl>")
            if p:
                need(Path(p).is_file(), f"reward_model.data.{key}={p}: no such file")
        need(data.held_out_path is not None or 0.0 < data.held_out_frac < 1.0,
             f"reward_model.data.held_out_frac={data.held_out_frac} must lie in (0, 1) without a held_out_path")
    else:
        from grpo_lab.rewards import REWARDS

        need(data.pairs > 0 and data.held_out_pairs > 0, "reward_model.data.pairs and held_out_pairs must be > 0")
        need(data.samples_per_prompt >= 2, f"reward_model.data.samples_per_prompt={data.samples_per_prompt} must "
                                           "be >= 2 (a pair needs two completions of one prompt)")
        need(data.temperature > 0, f"reward_model.data.temperature={data.temperature} must be > 0")
        from grpo_lab.rollout import ROLLOUT_ENGINES

        need(data.engine in ROLLOUT_ENGINES, f"reward_model.data.engine={data.engine!r} is not a rollout engine "
                                             f"({', '.join(ROLLOUT_ENGINES.names())})")
        need(data.gold in REWARDS or ":" in data.gold or "." in data.gold,
             f"reward_model.data.gold={data.gold!r} is not a registered reward ({', '.join(REWARDS.names())}) "
             "nor a plug-in import path")


def _file_preferences(data, seed: int) -> tuple[list[RankedGroup], list[RankedGroup], dict]:
    groups = read_preferences(data.path)
    if data.held_out_path:
        held_out = read_preferences(data.held_out_path)
    else:   # the file's last lines: a file sorted by prompt keeps held-out prompts apart from training ones
        cut = len(groups) - max(1, round(data.held_out_frac * len(groups)))
        if cut < 1:
            raise ConfigError(f"reward_model.data.path={data.path} has {len(groups)} preference(s): too few to hold "
                              "out reward_model.data.held_out_frac of them; add lines or give a held_out_path")
        groups, held_out = groups[:cut], groups[cut:]
    return groups, held_out, {"source": "jsonl", "train_groups": len(groups), "held_out_groups": len(held_out)}


def _sample_groups(engine, tokenizer, items, data, reward_cfg, *, n: int, max_new_tokens: int, seed: int,
                   rng: random.Random, margin_scale: float) -> tuple[list[RankedGroup], dict]:
    """Ranked groups from `samples_per_prompt` samples of `items`' prompts, labelled by the gold reward, in
    batches of prompts until `n` groups are found or the items run out."""
    from grpo_lab.learner.batch import encode_prompt
    from grpo_lab.rewards import compute_rewards, contained_settings

    groups: list[RankedGroup] = []
    order = list(range(len(items)))
    rng.shuffle(order)
    sampled, gold_sum, chunk = 0, 0.0, 64
    for start in range(0, len(order), chunk):
        if len(groups) >= n:
            break
        batch = [items[i] for i in order[start:start + chunk]]
        rollout = engine.generate([encode_prompt(tokenizer, it.prompt) for it in batch], n=data.samples_per_prompt,
                                  temperature=data.temperature, top_p=1.0, max_new_tokens=max_new_tokens,
                                  seed=seed + start)
        seq_items = [batch[g] for g in rollout.group_ids]
        scores, _ = compute_rewards(rollout.texts, seq_items, [(data.gold, 1.0)], **contained_settings(reward_cfg))
        k = data.samples_per_prompt
        texts = [rollout.texts[i * k:(i + 1) * k] for i in range(len(batch))]
        gold = [scores[i * k:(i + 1) * k] for i in range(len(batch))]
        sampled += len(scores)
        gold_sum += sum(scores)
        groups += groups_from_scores([it.prompt for it in batch], texts, gold, form=data.form, n=len(batch) * k * k,
                                     rng=rng, margin_scale=margin_scale)
    if len(groups) > n:
        groups = rng.sample(groups, n)
    return groups, {"samples": sampled, "gold_mean": gold_sum / max(sampled, 1)}


def make_preferences(cfg, start) -> tuple[list[RankedGroup], list[RankedGroup], dict]:
    """(train groups, held-out groups, stats): the jsonl file's, or labelled samples of the starting policy
    (train prompts for training, dev prompts held out), with training labels swapped at data.label_noise."""
    rm, data = cfg.reward_model, cfg.reward_model.data
    rng = random.Random(cfg.seed)
    if data.source == "jsonl":
        train, held_out, stats = _file_preferences(data, cfg.seed)
    else:
        from grpo_lab.progress import heartbeat
        from grpo_lab.rollout import make_engine, rollout_section

        engine_cfg = rollout_section(**{**as_dict(cfg.rollout), "engine": data.engine})
        engine = make_engine(start.policy_dir, engine_cfg, seed=cfg.seed, device=str(start.device))
        try:
            with heartbeat(f"reward model data: sampling {data.samples_per_prompt} completions per prompt from "
                           f"{start.policy_dir}, labelled by {data.gold}"):
                common = dict(max_new_tokens=cfg.rollout.max_new_tokens, rng=rng, margin_scale=rm.margin_scale)
                train, train_stats = _sample_groups(engine, start.tokenizer, start.task.splits["train"], data,
                                                    cfg.reward, n=data.pairs, seed=cfg.seed, **common)
                held_out, held_stats = _sample_groups(engine, start.tokenizer, start.task.splits["dev"], data,
                                                      cfg.reward, n=data.held_out_pairs, seed=cfg.seed + 1, **common)
        finally:
            engine.close()
        if not train or not held_out:
            raise ConfigError(
                f"the starting policy's samples gave {len(train)} training and {len(held_out)} held-out pairs: "
                f"every group's gold ({data.gold}) scores agree. Raise reward_model.data.samples_per_prompt or "
                "data.temperature, or start from a policy that is right only some of the time")
        stats = {"source": "policy_samples", "train_groups": len(train), "held_out_groups": len(held_out),
                 "train_samples": train_stats["samples"], "policy_gold_mean": train_stats["gold_mean"],
                 "held_out_samples": held_stats["samples"]}
    train, swapped = swap_labels(train, data.label_noise, rng)
    stats["swapped_labels"] = swapped
    return train, held_out, stats


# --------------------------------------------------------------------------------------------- the cache
def trunk_dir(cfg, start) -> Path:
    """The reward model's trunk directory (reward_model.trunk)."""
    rm = cfg.reward_model
    if rm.trunk == "path":
        return Path(rm.path)
    if rm.trunk == "base":
        from grpo_lab.interaction import message_alphabet
        from grpo_lab.models import build_model_dir

        alphabet = start.task.alphabet() + message_alphabet(cfg.interaction)
        return build_model_dir(cfg.model, alphabet=alphabet, seed=cfg.seed, cache_dir=Path(cfg.cache_dir))
    return start.policy_dir


def reward_model_key(cfg, start) -> str:
    """Everything that shapes the trained reward models: the section (less the cache switch), its trunk and
    data (files by content; sampled data by the policy's cached checkpoint, task and rollout length), the seed."""
    rm = as_dict(cfg.reward_model)
    rm.pop("cache")
    trunk = trunk_dir(cfg, start)
    # Cached checkpoints are named by their own content key: their last two path parts name them.
    trunk_id = [trunk.parent.name, trunk.name] if rm["trunk"] != "path" else [_dir_digest(trunk)]
    data = rm["data"]
    if data["source"] == "jsonl":
        data_id = [_sha256(data["path"])] + ([_sha256(data["held_out_path"])] if data["held_out_path"] else [])
    else:
        data_id = [start.policy_dir.parent.name, start.policy_dir.name, as_dict(cfg.task),
                   cfg.rollout.max_new_tokens, as_dict(cfg.reward)["timeout_s"]]
    return cache_key(rm, trunk_id, data_id, cfg.seed)


def _dir_digest(path: Path) -> str:
    """A digest of a directory's config and weight files' names, sizes and modification times (cheap: no read)."""
    parts = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in path.iterdir() if p.is_file())
    return cache_key(str(path.resolve()), parts)


def member_dirs(out: Path, k: int) -> list[Path]:
    return [out / f"member_{i}" for i in range(k)]


def build_reward_models(cfg, start, *, log=print) -> tuple[list[Path], dict]:
    """The trained reward models (ensemble members' directories) and their training stats, from the cache
    when an equal one was trained before (reward_model.cache), else trained now and cached atomically."""
    from grpo_lab.second_models.reward_model import RewardModel

    rm_cfg = cfg.reward_model
    out = Path(cfg.cache_dir) / "reward_models" / reward_model_key(cfg, start)
    stats_file = out / "reward_model.json"
    if rm_cfg.cache and stats_file.is_file():
        stats = json.loads(stats_file.read_text())
        log(f"reward model: cached {out} (held-out accuracy {stats['held_out_accuracy']:.3f})")
        return member_dirs(out, rm_cfg.ensemble_size), stats
    started = time.perf_counter()
    train, held_out, data_stats = make_preferences(cfg, start)
    trunk = trunk_dir(cfg, start)
    members = []
    for i in range(rm_cfg.ensemble_size):
        rm = RewardModel(trunk, lr=rm_cfg.lr, grad_clip=rm_cfg.grad_clip, seed=cfg.seed + i, lora=rm_cfg.lora,
                         dtype=rm_cfg.dtype, device=str(start.device), weight_decay=rm_cfg.weight_decay)
        history, best = fit(rm, train, held_out, rm_cfg, seed=cfg.seed + i, log=log)
        members.append((rm, history, best))
    stats = {
        "dir": str(out), "trunk": str(trunk), "data": data_stats,
        "held_out_accuracy": sum(b["reward_model/held_out/accuracy"] for _, _, b in members) / len(members),
        "members": [{"best": b, "history": h} for _, h, b in members],
        "train_time_s": time.perf_counter() - started,
    }

    def write(tmp: Path) -> None:
        for (rm, _, _), member in zip(members, member_dirs(tmp, len(members))):
            rm.save(member)
        (tmp / "reward_model.json").write_text(json.dumps(stats, indent=1))
    write_dir_atomically(out, write)
    return member_dirs(out, rm_cfg.ensemble_size), stats
