"""What a run does before its loop, and how it records its outcome: one implementation for the RL
trainer (grpo_lab.train) and the matched-compute SFT control (grpo_lab.tables.sft_control).

The control answers "does RL beat spending the same compute on more SFT?" only if it starts where the
RL runs start and computes with what their learner computes with. Both therefore begin with
`start_run`: the same seed, the same learner thread count (`learner_threads`, the trainer's rule for
learner.num_threads=null), the same device, task, cached model + warm-up checkpoint and tokenizer.

An RL run goes on with `assemble`: every part of the run (learner, engine, environment, sampling pipeline,
objective, evaluator) built once from its own section of the config, so the loop reads no config at all.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import AutoTokenizer

from grpo_lab import checkpoint
from grpo_lab.backends import TRAINER_BACKENDS
from grpo_lab.cpu_placement import engine_cores, plan_placement
from grpo_lab.evaluation import Evaluator
from grpo_lab.interaction import build_environment, message_alphabet, reference_problem
from grpo_lab.learner import distributed
from grpo_lab.objectives import OBJECTIVES
from grpo_lab.progress import heartbeat
from grpo_lab.rollout import ROLLOUT_ENGINES
from grpo_lab.sampling import RewardNormalizer, RolloutPipeline
from grpo_lab.schema import ConfigError, as_dict
from grpo_lab.interaction.demos import revision_demos, tool_demos
from grpo_lab.learner.batch import encode_prompt
from grpo_lab.learner.learner import resolve_device, set_cpu_threads
from grpo_lab.cache import cache_key
from grpo_lab.warmup import recorded_warmup_steps, warmup_key_settings, warmup_sft
from grpo_lab.logging.recorder import RunRecorder
from grpo_lab.models import build_model_dir
from grpo_lab.prompts import prepare_for_model
from grpo_lab.tasks import build_task
from grpo_lab.tasks.base import SPLIT_CHECK_FIELDS


def learner_threads(cfg: DictConfig) -> int:
    """CPU threads for the learner when learner.num_threads is null: half the cores when something else
    computes at the same time (an engine in its own process, or sampling ahead in a thread), else all
    of them, since oversubscribed OpenMP threads spin against each other. vLLM's engine counts even in
    the synchronous loop: with sub-second phases its idle threads still compete; with phases of tens of
    seconds they do not, so a recipe for a real model sets learner.num_threads itself
    (conf/experiment/smollm2_chain_sum.yaml). OMP_NUM_THREADS, when set, is the budget: joblib's loky
    workers get cores // n_jobs that way, so parallel sweep jobs do not oversubscribe the machine."""
    cores = int(os.environ.get("OMP_NUM_THREADS") or 0) or os.cpu_count() or 2
    competing = ROLLOUT_ENGINES.fact(cfg.rollout.engine, "own_process") or cfg.trainer.max_staleness > 0
    return max(1, cores // 2) if competing else cores


def set_learner_threads(cfg: DictConfig) -> int:
    """Set torch's intra-op threads to the learner's count (learner.num_threads, or `learner_threads`
    when null); returns it."""
    return set_cpu_threads(cfg.learner.num_threads or learner_threads(cfg))


def check_context(cfg: DictConfig, task, tokenizer) -> None:
    """Every prompt plus rollout.max_new_tokens must fit the engine's context: checked on the tokenized
    prompts before any training (the warm-up would otherwise train on them, and one 10,000-token row
    asks for gigabytes of attention) and before any engine starts. Rows over it refuse the run, or with
    task.drop_overlong=true leave every split, with a printed count. A multi-turn run needs room for
    every actor turn (interaction.max_turns answers of up to rollout.max_new_tokens each); the
    environment's messages, whose length is not known before they are written, are checked as they
    come (grpo_lab/interaction/rollout.py ends a conversation that would overflow)."""
    turns = cfg.interaction.max_turns   # 1 without an environment
    answers = turns * cfg.rollout.max_new_tokens
    room = cfg.rollout.max_model_len - answers
    lengths = {name: [len(encode_prompt(tokenizer, it.prompt)) for it in split] for name, split in task.splits.items()}
    over = {name: [n > room for n in ls] for name, ls in lengths.items()}
    n_over, n_all = sum(sum(o) for o in over.values()), sum(len(ls) for ls in lengths.values())
    if not n_over:
        return
    longest = max(max(ls, default=0) for ls in lengths.values())
    data = f"task.path={cfg.task.path}" if cfg.task.path else f"task {cfg.task.name!r}"
    if not cfg.task.drop_overlong:
        raise ConfigError(
            f"rollout.max_model_len={cfg.rollout.max_model_len} is too small for {n_over} of {n_all} prompts of {data}: "
            f"the longest has {longest} tokens and rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
            + (f" for each of interaction.max_turns={turns} answers" if turns > 1 else "") +
            f"; raise rollout.max_model_len to >= {longest + answers} (within the model's context), lower "
            "rollout.max_new_tokens" + (" or interaction.max_turns" if turns > 1 else "") +
            ", or drop those rows with task.drop_overlong=true")
    for name, flags in over.items():
        task.splits[name] = [it for it, too_long in zip(task.splits[name], flags) if not too_long]
        if not task.splits[name]:
            raise ConfigError(f"task.drop_overlong=true dropped every prompt of the {name} split of {data} (none fits "
                              f"rollout.max_model_len={cfg.rollout.max_model_len} with rollout.max_new_tokens="
                              f"{cfg.rollout.max_new_tokens}); raise rollout.max_model_len")
    per_split = ", ".join(f"{name} {sum(flags)}" for name, flags in over.items() if any(flags))
    per_answer = f"{turns} x rollout.max_new_tokens" if turns > 1 else "rollout.max_new_tokens"
    print(f"task.drop_overlong: dropped {n_over} of {n_all} prompts of {data} longer than {room} tokens "
          f"(rollout.max_model_len - {per_answer}; {per_split})")


def build_policy(cfg: DictConfig, task, device: torch.device) -> tuple[Path, dict]:
    """Model built from config (cached), the prompts checked against the context (`check_context`), then
    supervised warm-up (cached): the RL starting point."""
    cache = Path(cfg.cache_dir)
    # A multi-turn run's character model must also read the environment's messages; "" when single-turn.
    alphabet = task.alphabet() + message_alphabet(cfg.interaction)
    base_dir = build_model_dir(cfg.model, alphabet=alphabet, seed=cfg.seed, cache_dir=cache)
    # Before the warm-up formats its targets: a chat model reads answers in its own style.
    tokenizer = prepare_for_model(task, AutoTokenizer.from_pretrained(str(base_dir)), cfg.task)
    check_context(cfg, task, tokenizer)   # every check on the data before any training, the warm-up's too
    if cfg.warmup.max_steps == 0:
        return base_dir, {"skipped": True}
    # A dataset read from files is keyed by their content too: one edited in place gets a new warm-up.
    data = [task.info["data_sha256"]] if task.info.get("data_sha256") else []
    # Revision and tool-use demonstrations (interaction.warmup_revision_frac / warmup_tool_frac > 0) key the
    # warm-up by their tokens, not by the interaction settings: rows that run different environments over the
    # same demonstrations (interaction.warmup_demos_from) share one warm-up checkpoint.
    demos = revision_demos(cfg, task.splits["train"], tokenizer, seed=cfg.seed)
    try:
        demos += tool_demos(cfg, task.splits["train"], tokenizer, seed=cfg.seed + 1)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    demo_key = [cache_key(demos)] if demos else []
    # The split check's fields gate the task without shaping it: left out, so they key no new warm-up.
    task_key = {k: v for k, v in as_dict(cfg.task).items() if k not in SPLIT_CHECK_FIELDS}
    # warmup.replay_steps keys no warm-up but this seed's replayed one (every other entry keeps its key).
    key = (cfg.model, task_key, warmup_key_settings(cfg.warmup), alphabet, cfg.seed, *data, *demo_key)
    warm_dir = cache / "warmup" / cache_key(*key)
    replay = (cfg.warmup.replay_steps or {}).get(cfg.seed)
    if replay is not None and recorded_warmup_steps(warm_dir) == replay:
        replay = None    # the cached warm-up stopped at the recorded step: it is the one to start from
    elif replay is not None:
        warm_dir = cache / "warmup" / cache_key(*key, {"replay_steps": replay})
    stats = warmup_sft(base_dir, warm_dir, task, cfg.warmup, max_new_tokens=cfg.rollout.max_new_tokens,
                       seed=cfg.seed, device=device, demos=demos, replay_steps=replay)
    stats["inputs"] = cache_key(*key)   # what built it, replayed or not: a table compares starts by it
    if stats.get("reached_target") is False:
        # RL from a policy that rarely answers right earns few rewards (most advantages 0): say so before it
        # starts, not only in summary.json (a cached warm-up says it again).
        w = cfg.warmup
        print(f"warning: the warm-up ended after {stats['steps']} steps at sampled dev accuracy "
              f"{stats['sampled_dev_accuracy']:.3g}, short of warmup.target_sampled_dev_accuracy="
              f"{w.target_sampled_dev_accuracy:g}; RL starts from it anyway. Raise warmup.max_steps (now "
              f"{w.max_steps}) or lower warmup.target_sampled_dev_accuracy", file=sys.stderr, flush=True)
    return warm_dir, stats


@dataclass(frozen=True)
class RunStart:
    """Where a run starts: its learner's threads and device, the task, the policy checkpoint (the
    warm-up's, or the built model when warm-up is off) with its warm-up stats, and the tokenizer."""
    threads: int
    device: torch.device
    task: object
    policy_dir: Path
    warmup: dict
    tokenizer: object

    @property
    def warmup_summary(self) -> dict:
        """The warm-up stats for summary.json (without the per-evaluation history)."""
        return {k: v for k, v in self.warmup.items() if k != "history"}


def start_run(cfg: DictConfig) -> RunStart:
    """Seed torch, set the learner's threads, resolve the device, build the task and the starting
    policy (both cached), and load its tokenizer prepared for the task."""
    torch.manual_seed(cfg.seed)
    threads = set_learner_threads(cfg)
    device = resolve_device(cfg.learner.device)
    task = build_task(cfg.task, cache_dir=cfg.cache_dir)
    problem = reference_problem(cfg.interaction, task)
    if problem:
        raise ConfigError(problem)
    policy_dir, warm = build_policy(cfg, task, device)
    tokenizer = prepare_for_model(task, AutoTokenizer.from_pretrained(str(policy_dir)), cfg.task)
    return RunStart(threads=threads, device=device, task=task, policy_dir=policy_dir, warmup=warm,
                    tokenizer=tokenizer)


def log_initial_eval(recorder: RunRecorder, start: RunStart, before: dict) -> None:
    """Step 0 of metrics.jsonl: the evaluation before training and the warm-up's step count."""
    recorder.log({**before, "warmup/steps": start.warmup.get("steps", 0)}, step=0, samples=0)


def open_recorder(run_dir: Path, cfg: DictConfig, overrides: list[str], *, sweep: str | None = None,
                  resume: dict | None = None, searchpath: list[str] = ()) -> RunRecorder:
    """The run's recorder; every `key=value` override counts as a swept key (the report's columns).
    `searchpath`: the launch's `hydra.searchpath=` override, if any, kept for `grpo_lab.resume`."""
    return RunRecorder(run_dir, cfg, overrides=overrides, sweep=sweep,
                       swept_keys=[o.split("=", 1)[0] for o in overrides if "=" in o], resume=resume,
                       searchpath=searchpath)


@dataclass
class RunParts:
    """What one RL run trains with, each part built once by `assemble` from its own config section: where
    it starts, the learner, the rollout engine, the pipeline that samples each step's batch, the objective
    with its algorithm section, the reward normalizer, the held-out evaluator, the trainer's budgets and
    cadences, the multi-turn environment (None: single-turn) and, when resuming, the checkpoint's state."""
    start: RunStart
    learner: Any
    engine: Any
    pipeline: RolloutPipeline
    objective: Any
    algorithm: Any
    normalizer: RewardNormalizer
    evaluator: Evaluator
    trainer: Any
    seed: int
    learner_lr: float   # named when the weights turn non-finite (the learner may be a remote proxy)
    environment: Any = None
    state: dict | None = None
    prepared_rewards: dict | None = None   # what rewards built before the run (a learned reward model's stats)
    online_rewards: list = field(default_factory=list)   # parts that keep training a reward during the run

    tokenizer: Any = field(init=False)   # the policy's (start.tokenizer), which the loop hands on each step

    def __post_init__(self) -> None:
        self.tokenizer = self.start.tokenizer

    def close(self) -> None:
        """The pipeline (and its reward worker), the environment and the engine, however the run ends."""
        self.pipeline.close()
        if self.environment is not None:
            self.environment.close()
        for part in self.online_rewards:
            part.close()
        self.engine.close()


def prepare_rewards(cfg, start: RunStart) -> dict | None:
    """What each reward of the run needs built before its first step, with the starting policy at hand (the
    REWARDS entry's `prepare` fact: a learned reward model trains here, cached); their stats by reward name
    (None when no reward prepares anything)."""
    from grpo_lab.rewards import REWARDS

    stats = {}
    for name in cfg.reward.weights:
        prepare = REWARDS.fact(str(name), "prepare") if name in REWARDS else None
        if prepare is not None and (result := prepare(cfg, start)) is not None:
            stats[str(name)] = result
    return stats or None


def online_rewards(cfg) -> list:
    """The parts that keep training the run's rewards during RL (the REWARDS entry's `online` fact)."""
    from grpo_lab.rewards import REWARDS

    parts = [REWARDS.fact(str(name), "online")(cfg) for name in cfg.reward.weights
             if name in REWARDS and REWARDS.fact(str(name), "online") is not None]
    return [p for p in parts if p is not None]


def learned_reward(reward_cfg):
    """(texts, items) -> the training reward, when it is learned (reward.weights names reward_model): the
    evaluation's proxy column. None otherwise (the training reward is a verifier: gold already)."""
    if "reward_model" not in reward_cfg.weights:
        return None
    from grpo_lab.rewards import RewardScorer

    scorer = RewardScorer(reward_cfg)
    return lambda texts, items: scorer(texts, items)[0]


def start_learner(cfg: DictConfig, start: RunStart, resume_from: Path | None) -> tuple[Any, Any, dict | None]:
    """(learner, engine builder, the checkpoint's state or None); a resumed learner loads its
    checkpoint here, before the engine starts, so a bad checkpoint fails cheaply."""
    # Where the learner and the engine run: this process (or torchrun ranks), or Ray actors (backends.py).
    build_learner, build_engine = TRAINER_BACKENDS.get(cfg.trainer.backend)(cfg)
    learner = build_learner(cfg, start.policy_dir, temperature=cfg.rollout.temperature, seed=cfg.seed,
                            max_completion_len=cfg.rollout.max_new_tokens)
    state = checkpoint.load(resume_from) if resume_from else None
    if state:
        learner.load_state(resume_from / "policy", state["learner"])
    return learner, build_engine, state


def start_engine(cfg: DictConfig, start: RunStart, build_engine: Any) -> Any:
    """The rollout engine, on the cores the CPU placement gives it."""
    t, device = cfg.trainer, start.device
    if device.type == "cuda":   # vLLM checks free GPU memory at start; the warm-up's cached blocks would count
        torch.cuda.empty_cache()
    placement = plan_placement(t.cpu_placement, overlapped=t.max_staleness > 0, n_learner=start.threads,
                               engine_own_process=ROLLOUT_ENGINES.fact(cfg.rollout.engine, "own_process"),
                               engine_on_cpu=not torch.cuda.is_available(),
                               spawns_engine=TRAINER_BACKENDS.fact(t.backend, "spawns_engine"),
                               distributed=distributed.launched_distributed())
    if placement:
        print(f"cpu placement: learner on cores {list(placement.learner)}, engine on {list(placement.engine)} "
              "(trainer.cpu_placement=shared: all cores to both)")
    with engine_cores(placement), heartbeat(f"rollout engine: starting {cfg.rollout.engine} on {device} "
                                            "(vLLM on a CPU: about a minute)"):
        return build_engine(start.policy_dir, cfg.rollout, seed=cfg.seed, device=str(device))


def assemble(cfg: DictConfig, resume_from: Path | None = None) -> RunParts:
    """Every part of an RL run, each handed its own section of `cfg`; the loop (grpo_lab.train) then reads
    no config. What was started before a later part failed is closed again."""
    start = start_run(cfg)   # seed, learner threads, device, task, warm-up checkpoint, tokenizer
    prepared = prepare_rewards(cfg, start)   # e.g. reward=reward_model without dirs: trained here (cached)
    learner, build_engine, state = start_learner(cfg, start, resume_from)
    engine = start_engine(cfg, start, build_engine)
    environment = None
    try:
        environment = build_environment(cfg, tokenizer=start.tokenizer, task=start.task)   # None: single-turn
        objective = OBJECTIVES.get(cfg.algorithm.objective).for_run(cfg.algorithm)
        sampler = objective.make_sampler(cfg, engine, start.tokenizer, start.task.splits["train"], environment)
        evaluator = Evaluator.of(engine, start.tokenizer, start.task.splits[cfg.trainer.eval_split],
                                 rollout=cfg.rollout, trainer=cfg.trainer, interaction=cfg.interaction, seed=cfg.seed,
                                 environment=environment, proxy=learned_reward(cfg.reward))
        return RunParts(start, learner, engine, RolloutPipeline(sampler, cfg, max_staleness=cfg.trainer.max_staleness),
                        objective, cfg.algorithm, RewardNormalizer(cfg.algorithm.reward_ema_decay), evaluator,
                        cfg.trainer, cfg.seed, cfg.learner.lr, environment, state, prepared,
                        online_rewards(cfg))
    except BaseException:
        if environment is not None:
            environment.close()
        engine.close()
        raise
