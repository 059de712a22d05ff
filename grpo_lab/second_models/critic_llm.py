"""The critic LLM: a second, smaller model that reads the question and the actor's answer, writes short
feedback as the actor's environment, and learns alongside the actor on its own rhythm.

The actor answers; the critic writes feedback (critique-then-revise: Saunders et al. 2022, arXiv
2206.05802; a trained critic model: CriticGPT, McAleese et al. 2024, arXiv 2407.00215); unless the
critic's verdict is "correct" the actor revises. Formats (a one-letter verdict for the character-level
tiny model, after its own answer; a sentence through the chat template for a chat model) are in
grpo_lab/interaction/critic_feedback.py; the rollout loop sees only the environment contract
(grpo_lab/interaction/base.py). The model is a `SecondModel` (grpo_lab/second_models/base.py): its
optimizer step, its SFT and its RL step are the ones every model of the lab trains with.

Life of the critic, configured under ``interaction.critic`` (`CriticLLMConfig`, conf/interaction/critic.yaml):

1. **Model**: ``critic.model`` is a model section as conf/model/*.yaml (built and cached by
   `grpo_lab.models.build_model_dir`, as the actor's), generating through its own HF engine
   (grpo_lab.rollout's ``hf`` entry) on the CPU. A LoRA critic adapter over the actor's own base
   would save the second model's memory; it is not built here.
2. **Warm-up** (``critic.warmup``, a warm-up section as the actor's): SFT on synthetic (question,
   candidate answer) -> verifier feedback pairs from the task's train split (the reference or a
   perturbed one), stopped and scored on pairs from the dev split, cached by a hash of the model,
   settings and data (grpo_lab.warmup.warmup_sft). A frozen critic (``critic.train=false``) stays there.
3. **Training while the actor trains** (``critic.train``, the `CRITIC_TRAINING` registry), one update
   every ``critic.update_every`` actor steps on the examples gathered since the last one: alternating
   updates of two learners, as a GAN's generator and discriminator (Goodfellow et al. 2014, arXiv
   1406.2661).

   * ``sft_top_bottom``: the top ``top_frac`` of the step's first answers by task reward are
     positives (target: "correct" feedback), the bottom ``bottom_frac`` negatives (target: the bare
     "wrong" verdict, since a scalar reward says nothing about what is wrong; solve_compact writes the
     item's reference answer before either letter); ties: `critic_feedback.top_bottom`.
     ``sft_steps`` SFT steps per update (`SecondModel.sft_update`: the warm-up's own SFT loop).
   * ``rl``: the critic's sampled feedback is an action, rewarded +1 when the revision it led to
     turned a wrong first answer right, −1 when it turned a right one wrong, 0 otherwise (the
     revision-outcome reward of CTRL, Xie et al. 2025, arXiv 2502.03492; SCoRe, arXiv 2409.12917,
     rewards the same first-to-second-turn progress in the actor), plus ``agreement_coef`` when
     its verdict agrees with the verifier. That term is needed: a "correct" verdict ends the
     conversation, so it never earns −1 and never +1, and a critic rewarded only through revisions
     learns that saying "correct" to everything is safe (reward 0, never negative); the agreement
     term keeps the verdict tied to the verifier. ``rl_steps`` policy-gradient steps per update with
     the registered advantage (``advantage``, one batch-wide group: a batch-mean baseline, REINFORCE
     with baseline) and policy loss (``policy_loss``; the sampler's logprobs kept from generation are
     π_old, so a clipped surrogate makes several steps safe). Only the feedback on a conversation's
     first answer is trained on (``max_turns: 2`` has no other). The step is `SecondModel.rl_update`:
     the policy-gradient objective the actor trains with, clipped at ``critic.grad_clip``.

Only sampled replies (``greedy=False``: training rollouts) are actions: `reply` keeps each one (its
prompt and feedback ids, sampler logprobs, verdict), keyed by (question, answer), until `after_step`
matches it with the step's first answers; replies not matched within two steps are dropped.
`after_step` returns, under its own prefix ``critic_llm/`` (``critic/`` is PPO's value model):
``critic_llm/verdict_acc`` (agreement of the critic's verdict on the step's first answers with the
verifier; an unreadable verdict disagrees), ``critic_llm/feedback_len`` (tokens),
``critic_llm/examples`` (training examples gathered this step), ``critic_llm/updates`` (so far) and
``critic_llm/loss`` (only on a step that updated).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from grpo_lab.algos import ADVANTAGE_ESTIMATORS, AGGREGATIONS, POLICY_LOSSES
from grpo_lab.cache import cache_key
from grpo_lab.interaction import ENVIRONMENTS
from grpo_lab.interaction.base import EnvReply, StepRecord
from grpo_lab.interaction.critic_feedback import (COMPACT_CHARS, FEEDBACK_FORMATS, FeedbackFormat, items_digest,
                                                  revision_reward, synthetic_task, top_bottom, verifier_kind)
from grpo_lab.learner.batch import encode_prompt
from grpo_lab.models import MODEL_BUILDERS, build_model_dir
from grpo_lab.models.builders import settings_errors
from grpo_lab.models.model_dir import TOKENIZER_FILES, WEIGHT_FILES, is_complete_model_dir
from grpo_lab.prompts import uses_chat_template
from grpo_lab.registry import Registry
from grpo_lab.rollout import make_engine, rollout_section
from grpo_lab.schema import SAMPLERS, AlgorithmConfig, ConfigError, CriticLLMConfig
from grpo_lab.second_models.base import SecondModel
from grpo_lab.tasks import TaskItem
from grpo_lab.warmup import warmup_key_settings, warmup_sft

# Facts: `learns` (the critic's weights change during the run) and `update` (env, examples) -> loss, the
# update run every critic.update_every actor steps on the examples the entry gathered.
CRITIC_TRAINING = Registry("critic training", defaults={"learns": True, "update": None})
_FROZEN_SPELLINGS = (False, None, "false", "False", "frozen", "none")


def training_mode(train: Any) -> str:
    """``critic.train`` as a `CRITIC_TRAINING` name (false, null and "frozen" all mean frozen)."""
    return "frozen" if train in _FROZEN_SPELLINGS else str(train)


def critic_config(cfg: DictConfig) -> DictConfig:
    """The typed, checked ``interaction.critic`` section of the run config `cfg` (an unknown key or a
    bad value raises a ConfigError naming the key, before any model is built)."""
    try:
        c = OmegaConf.merge(OmegaConf.structured(CriticLLMConfig), cfg.interaction.critic)
    except Exception as err:   # OmegaConf's own message names the key and the type
        raise ConfigError(f"interaction.critic: {err}") from err
    errors = _config_errors(c)
    if errors:
        raise ConfigError("interaction.critic:\n  " + "\n  ".join(errors))
    return c


def _config_errors(c: DictConfig) -> list[str]:
    checks = [
        (training_mode(c.train) in CRITIC_TRAINING, f"interaction.critic.train={c.train!r}; valid: false (frozen), "
                                                    "sft_top_bottom, rl"),
        (c.model.builder in MODEL_BUILDERS, f"interaction.critic.model.builder={c.model.builder!r}; valid: "
                                            f"{', '.join(MODEL_BUILDERS.names())}"),
        (c.model.builder not in MODEL_BUILDERS or not MODEL_BUILDERS.fact(c.model.builder, "needs_path")
         or bool(c.model.path), f"interaction.critic.model.builder={c.model.builder} needs "
                                "interaction.critic.model.path=<local HF model directory>"),
        (0.0 <= c.top_frac <= 1.0 and 0.0 <= c.bottom_frac <= 1.0,
         "interaction.critic.top_frac and bottom_frac must lie in [0, 1] (e.g. 0.1)"),
        (c.update_every >= 1, f"interaction.critic.update_every={c.update_every} must be >= 1 (actor steps per "
                              "critic update)"),
        (c.max_new_tokens >= 1, "interaction.critic.max_new_tokens must be >= 1 (the verdict needs a token)"),
        (c.feedback_format in ("auto", *FEEDBACK_FORMATS), f"interaction.critic.feedback_format="
         f"{c.feedback_format!r}; valid: auto, {', '.join(FEEDBACK_FORMATS)}"),
        (c.sampler in SAMPLERS, f"interaction.critic.sampler={c.sampler!r}; valid: {', '.join(SAMPLERS)}"),
        (c.temperature > 0, "interaction.critic.temperature must be > 0 (greedy is chosen per call by reply(greedy=))"),
        (c.advantage in ADVANTAGE_ESTIMATORS and not ADVANTAGE_ESTIMATORS.fact(c.advantage, "needs_critic"),
         f"interaction.critic.advantage={c.advantage!r}: give an outcome estimator of ADVANTAGE_ESTIMATORS "
         "(e.g. group_mean)"),
        (c.policy_loss in POLICY_LOSSES, f"interaction.critic.policy_loss={c.policy_loss!r}; valid: "
                                         f"{', '.join(POLICY_LOSSES.names())}"),
        (c.loss_agg_mode in AGGREGATIONS, f"interaction.critic.loss_agg_mode={c.loss_agg_mode!r}; valid: "
                                          f"{', '.join(AGGREGATIONS.names())}"),
        (c.lr > 0 and c.grad_clip >= 0, f"interaction.critic.lr={c.lr} must be > 0 and interaction.critic.grad_clip="
                                        f"{c.grad_clip} >= 0 (0 = no clipping)"),
        (min(c.max_offset, c.batch_size, c.warmup_pairs_per_item) >= 1 and min(c.sft_steps, c.rl_steps) >= 0,
         "interaction.critic.max_offset, batch_size and warmup_pairs_per_item must be >= 1, sft_steps and "
         "rl_steps >= 0"),
    ]
    errors = [message for ok, message in checks if not ok]
    if c.model.builder in MODEL_BUILDERS:
        errors += settings_errors(c.model, "interaction.critic.model")
    return errors


def _model_dir_errors(c: DictConfig) -> list[str]:
    """The critic's local model directory (a builder that needs a path) is on this machine and holds a model:
    else the actor's warm-up, engine and first steps run before the critic fails to load."""
    path = c.model.path
    if not path or c.model.builder not in MODEL_BUILDERS or not MODEL_BUILDERS.fact(c.model.builder, "needs_path"):
        return []
    p = Path(str(path)).expanduser()
    if not p.is_dir():
        return [f"interaction.critic.model.path={str(path)!r} is not a directory on this machine: give a local HF "
                "model directory (saved with save_pretrained: config.json, weights, tokenizer files; hub names are not "
                "downloaded here), or use interaction=critic (the tiny critic, built from scratch)"]
    if not is_complete_model_dir(p):
        return [f"interaction.critic.model.path={str(path)!r} is not a complete HF model directory: give one with "
                f"config.json, one of {', '.join(WEIGHT_FILES)} and one of {', '.join(TOKENIZER_FILES)} (found: "
                f"{', '.join(sorted(f.name for f in p.iterdir())) or 'nothing'})"]
    return []


def feedback_format(tokenizer, name: str = "auto") -> FeedbackFormat:
    """`FEEDBACK_FORMATS[name]`; ``auto``: the chat format for a tokenizer with a chat template, else
    solve_compact."""
    if name == "auto":
        name = "chat" if uses_chat_template(tokenizer) else "solve_compact"
    return FEEDBACK_FORMATS[name]


def warm_up_critic(base_dir: Path, task, fmt: FeedbackFormat, c: DictConfig, *, cache_dir: Path,
                   seed: int) -> tuple[Path, dict]:
    """The critic's starting checkpoint: `base_dir` after the synthetic-feedback SFT (cached), and its stats
    (greedy_dev_accuracy: exact feedback on held-out pairs). The global torch RNG is left as it was."""
    if c.warmup.max_steps == 0:
        return base_dir, {"skipped": True}
    data = synthetic_task(task, fmt, seed=seed, max_offset=c.max_offset, per_item=c.warmup_pairs_per_item,
                          dev_size=c.warmup_dev_size)
    out_dir = Path(cache_dir) / "critic_warmup" / cache_key(c.model, warmup_key_settings(c.warmup), fmt.name, c.max_new_tokens, seed,
                                                           items_digest(data))
    with torch.random.fork_rng(devices=[]):
        stats = warmup_sft(base_dir, out_dir, data, c.warmup, max_new_tokens=c.max_new_tokens, seed=seed,
                           device=torch.device("cpu"))
    return out_dir, stats


def _key(item: TaskItem, answer: str) -> str:
    return json.dumps([item.prompt, answer])


class CriticEnvironment:
    """The critic LLM environment (module docstring); ``cls(cfg, *, tokenizer, task)`` as every environment."""

    @staticmethod
    def config_errors(cfg: DictConfig, machine: bool = True) -> list[str]:
        """What is wrong with the run's interaction.critic section (checked with the config, before any
        model is built); ``machine``: also what only this machine can tell (the critic's model directory is here)."""
        try:
            c = critic_config(cfg)
        except ConfigError as err:
            return [str(err)]
        errors = [] if c.warmup.replay_steps is None else [
            f"interaction.critic.warmup.replay_steps={c.warmup.replay_steps}: the critic's warm-up has no recorded "
            "length to replay (only the policy's warm-up does, warmup.replay_steps); remove it"]
        return errors + (_model_dir_errors(c) if machine else [])

    @staticmethod
    def demo_message(cfg: DictConfig, item: TaskItem, answer: str) -> str:
        """What a critic that judged `answer` as the verifier does would show the actor (for revision
        demonstrations in the actor's warm-up): the message of the verifier's feedback kind, in the format
        this run's critic writes (`auto`: the compact letter for a from-scratch character model, else chat)."""
        c = critic_config(cfg)
        name = c.feedback_format
        if name == "auto":
            name = "solve_compact" if MODEL_BUILDERS.fact(c.model.builder, "per_task") else "chat"
        fmt = FEEDBACK_FORMATS[name]
        return fmt.message(fmt.target(verifier_kind(item, answer), item.answer))

    def __init__(self, cfg: DictConfig, *, tokenizer=None, task):
        self.config = critic_config(cfg)
        self.mode = training_mode(self.config.train)
        self.seed = int(cfg.seed)
        cache_dir = Path(cfg.cache_dir)
        # Digits and '-' too: perturbed candidates may hold a sign the task's answers never do.
        alphabet = task.alphabet() + COMPACT_CHARS + "-0123456789"
        base_dir = build_model_dir(self.config.model, alphabet=alphabet, seed=self.seed, cache_dir=cache_dir)
        self.format = feedback_format(AutoTokenizer.from_pretrained(str(base_dir)), self.config.feedback_format)
        self.model_dir, self.warmup_stats = warm_up_critic(base_dir, task, self.format, self.config,
                                                           cache_dir=cache_dir, seed=self.seed)
        rollout = rollout_section(engine="hf", dtype="float32", sampler=self.config.sampler)
        self.engine = make_engine(self.model_dir, rollout, seed=self.seed, device="cpu")
        self.tokenizer = self.engine.tokenizer
        self.critic = SecondModel.causal_lm(self.model_dir, lr=self.config.lr, grad_clip=self.config.grad_clip,
                                            prefix="critic_llm/")
        self.model = self.critic.model
        self.pending: list[dict] = []          # training examples gathered since the last update
        self.stash: dict[str, list[dict]] = {}   # sampled replies not yet matched by after_step
        self.updates = 0
        self.steps_since_update = 0

    # ------------------------------------------------------------------ generation
    def prompt_ids(self, item: TaskItem, answer: str) -> list[int]:
        return encode_prompt(self.tokenizer, self.format.prompt(item.prompt, answer))

    def reply(self, items: list, conversations: list[list[str]], *, seed: int, greedy: bool) -> list[EnvReply]:
        """One batched generation of feedback on each conversation's last answer; greedy, or sampled at
        critic.temperature from `seed` (the global torch RNG is left as it was). A "correct" verdict ends
        the conversation; any other feedback (an unreadable one too, verdict None) is the actor's next
        user turn."""
        if not items:
            return []
        answers = [conv[-1] for conv in conversations]
        prompts = [self.prompt_ids(item, answer) for item, answer in zip(items, answers)]
        with torch.random.fork_rng(devices=[]):
            out = self.engine.generate(prompts, n=1, temperature=0.0 if greedy else self.config.temperature,
                                       top_p=1.0, max_new_tokens=self.config.max_new_tokens,
                                       seed=seed * 1_000_003 + 17, logprobs=not greedy)
        replies = []
        for k, (item, answer) in enumerate(zip(items, answers)):
            text, verdict = out.texts[k], self.format.parse(out.texts[k])
            message = self.format.message(text)
            if not greedy:
                self.stash.setdefault(_key(item, answer), []).append(
                    {"prompt_ids": prompts[k], "completion_ids": out.completion_ids[k],
                     "logprobs": out.sampler_logprobs[k], "message": message, "verdict": verdict, "age": 0})
            replies.append(EnvReply(message=None if verdict else message, done=verdict is True,
                                    verdict=verdict, info={"critic_text": text}))
        return replies

    # ------------------------------------------------------------------ learning
    def _match(self, record: StepRecord) -> list[dict | None]:
        """Per sequence, the sampled reply that judged its first answer (one whose message is the one the
        actor saw, or, when the conversation ended there, one with a "correct" verdict: replies that showed
        the actor the same thing are interchangeable draws); unmatched replies age and are dropped after
        two steps (rollouts sampled ahead of an update)."""
        matched = []
        for item, answers, messages in zip(record.items, record.answers, record.messages):
            entries = self.stash.get(_key(item, answers[0]), [])
            wanted = [e for e in entries if (e["message"] == messages[0] if messages else e["verdict"] is True)]
            entry = (wanted or entries or [None])[0]
            if entry is not None:
                entries.remove(entry)
            matched.append(entry)
        for key in list(self.stash):
            self.stash[key] = [{**e, "age": e["age"] + 1} for e in self.stash[key] if e["age"] < 1]
            if not self.stash[key]:
                del self.stash[key]
        return matched

    def after_step(self, step: int, record: StepRecord) -> dict[str, float]:
        """Gather this step's examples, update every critic.update_every steps; returns critic_llm/ metrics."""
        matched = self._match(record)
        truth = [verifier_kind(item, answers[0]) == "correct" for item, answers in zip(record.items, record.answers)]
        metrics = self._judgement_metrics(record, matched, truth)
        examples = CRITIC_TRAINING.get(self.mode)(self, step, record, matched, truth)
        self.pending += examples
        self.steps_since_update += 1
        if CRITIC_TRAINING.fact(self.mode, "learns") and self.steps_since_update >= self.config.update_every:
            self.steps_since_update = 0
            if self.pending:
                metrics["loss"] = self._update()
                self.updates += 1
            self.pending = []
        return self.critic.metrics({**metrics, "examples": float(len(examples)), "updates": float(self.updates)})

    def _judgement_metrics(self, record: StepRecord, matched: list, truth: list[bool]) -> dict[str, float]:
        verdicts = [m["verdict"] if m is not None else (v[0] if v else None)
                    for m, v in zip(matched, record.verdicts)]
        known = [(v, t) for v, t, m, rv in zip(verdicts, truth, matched, record.verdicts) if m is not None or rv]
        lengths = [len(m["completion_ids"]) for m in matched if m is not None]
        metrics = {}
        if known:
            metrics["verdict_acc"] = sum(v is t for v, t in known) / len(known)
        if lengths:
            metrics["feedback_len"] = sum(lengths) / len(lengths)
        return metrics

    def _update(self) -> float:
        """The registered mode's update on the pending examples; the engine gets the new weights."""
        loss = CRITIC_TRAINING.fact(self.mode, "update")(self, self.pending)
        self.engine.load_weights(self.model.named_parameters())
        return loss

    def update_seed(self) -> int:
        """Seed of the next update's batch draws: a function of the run seed and the update count, so a
        resumed run draws what the uninterrupted one would."""
        return self.seed * 1_000_003 + 7919 * (self.updates + 1)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Weights, optimizer, counters, pending examples and unmatched replies: what a resumed run needs
        to continue exactly (generation draws come from reply's seed)."""
        return {**self.critic.state_dict(), **copy.deepcopy({
            "pending": self.pending, "stash": self.stash, "updates": self.updates,
            "steps_since_update": self.steps_since_update, "mode": self.mode})}

    def load_state_dict(self, state: dict) -> None:
        if state["mode"] != self.mode:
            raise ConfigError(f"the checkpoint's critic was trained with interaction.critic.train={state['mode']}, "
                              f"this run sets {self.mode}: resume with the same setting")
        self.critic.load_state_dict(state)
        self.engine.load_weights(self.model.named_parameters())
        state = copy.deepcopy(state)
        self.pending, self.stash = state["pending"], state["stash"]
        self.updates, self.steps_since_update = state["updates"], state["steps_since_update"]

    def close(self) -> None:
        self.engine.close()


# ---------------------------------------------------------------------- training modes
def _sft_update(env: CriticEnvironment, examples: list[dict]) -> float:
    """critic.sft_steps SFT steps on batches drawn from `examples` ({"prompt", "target"} texts)."""
    if env.config.sft_steps == 0:
        return float("nan")
    return env.critic.sft_update(env.tokenizer, examples, batch_size=env.config.batch_size,
                                 steps=env.config.sft_steps, seed=env.update_seed())


def rl_algorithm(c: DictConfig) -> DictConfig:
    """The critic's RL settings as the algorithm section the policy-gradient objective reads."""
    return OmegaConf.structured(AlgorithmConfig(name="critic_llm", advantage=c.advantage, policy_loss=c.policy_loss,
                                                clip_low=c.clip_low, clip_high=c.clip_high,
                                                aggregation=c.loss_agg_mode))


def _rl_update(env: CriticEnvironment, examples: list[dict]) -> float:
    """critic.rl_steps policy-gradient steps on `examples` (feedback ids, sampler logprobs, reward): the
    registered advantage over the whole batch as one group (a batch-mean baseline), the registered
    policy loss on random minibatches of critic.batch_size (`SecondModel.rl_update`)."""
    c = env.config
    return env.critic.rl_update(examples, rl_algorithm(c), pad_id=env.tokenizer.pad_token_id,
                                batch_size=c.batch_size, steps=c.rl_steps, seed=env.update_seed(),
                                temperature=c.temperature)


@CRITIC_TRAINING.register("frozen", learns=False)
def _frozen(env: CriticEnvironment, step: int, record: StepRecord, matched: list, truth: list[bool]) -> list[dict]:
    """After its warm-up the critic does not change."""
    return []


@CRITIC_TRAINING.register("sft_top_bottom", update=_sft_update)
def _top_bottom_examples(env: CriticEnvironment, step: int, record: StepRecord, matched: list,
                         truth: list[bool]) -> list[dict]:
    """The step's best first answers as "correct" targets, its worst as bare "wrong" ones."""
    c, fmt = env.config, env.format
    gen = torch.Generator().manual_seed(env.seed * 1_000_003 + step)
    top, bottom = top_bottom([r[0] for r in record.turn_rewards], c.top_frac, c.bottom_frac, gen)
    return [{"prompt": fmt.prompt(record.items[i].prompt, record.answers[i][0]),
             "target": fmt.target(kind, record.items[i].answer)}
            for ids, kind in ((top, "correct"), (bottom, "wrong")) for i in ids]


@CRITIC_TRAINING.register("rl", update=_rl_update)
def _revision_examples(env: CriticEnvironment, step: int, record: StepRecord, matched: list,
                       truth: list[bool]) -> list[dict]:
    """Each matched sampled feedback with its revision reward (`critic_feedback.revision_reward`)."""
    out = []
    for item, answers, entry, first in zip(record.items, record.answers, matched, truth):
        if entry is None or not entry["completion_ids"]:
            continue
        second = verifier_kind(item, answers[1]) == "correct" if len(answers) > 1 else None
        reward = revision_reward(first, second, entry["verdict"] is first, env.config.agreement_coef)
        out.append({"prompt_ids": entry["prompt_ids"], "completion_ids": entry["completion_ids"],
                    "logprobs": entry["logprobs"], "reward": reward})
    return out


__all__ = ["CRITIC_TRAINING", "CriticEnvironment", "CriticLLMConfig", "critic_config", "feedback_format",
           "training_mode", "warm_up_critic"]


# The actor sees the compact formats' letters (CHLW), so a character-level actor needs them in its alphabet.
ENVIRONMENTS.register("critic", learns=True, needs_reference=True, alphabet=COMPACT_CHARS[1:], reads=("critic",))(CriticEnvironment)
