"""Held-out evaluation: one function (`evaluate`) for the RL loop, the warm-up SFT and the SFT control, and
a run's `Evaluator`, its settings read once from the run's sections.

Greedy by default (temperature 0: the number every table reports); sampled when temperature > 0
(the warm-up's stopping signal: greedy accuracy runs far ahead of what sampled rollouts see, so a
warm-up stopped on greedy accuracy leaves RL a policy whose samples are mostly wrong).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from grpo_lab.interaction import multi_turn_rollout
from grpo_lab.interaction.rewards import conversation_metrics
from grpo_lab.learner.batch import encode_prompt
from grpo_lab.rewards import is_correct


def evaluate(engine, tokenizer, items: list, *, max_new_tokens: int, temperature: float = 0.0, n: int = 1,
             seed: int = 0, samples: list | None = None, max_samples: int = 0, environment=None,
             max_turns: int = 1, max_model_len: int | None = None, proxy=None) -> dict:
    """Accuracy of `n` completions per held-out item, and the mean completion length of right and wrong ones.

    engine: any RolloutEngine (grpo_lab.rollout); its weights are the ones evaluated.
    Returns eval/accuracy (fraction of the len(items) * n completions that are correct),
    eval/completion_len_mean and eval/wrong_len_mean (tokens; 0 when nothing is wrong) and eval/n
    (number of items). With `samples` (a list), its first `max_samples` completions are appended to
    it as readable rows (prompt, completion, answer, correct) for samples.jsonl.

    With an `environment` (grpo_lab.interaction), each completion is a conversation of up to
    `max_turns` answers (first answer, the environment's reply, revision, ...), within `max_model_len`
    tokens (the engine's context, required then): eval/accuracy is the final answer's, and
    eval/first_acc, eval/wrong_to_right, eval/right_to_wrong say what the revision changed; rows gain
    `turns` and `env_info` (each reply's extras); an environment with an `info_metrics(env_info)` method (a
    tool: calls, errors) adds its metrics under eval/ (eval/tool/calls_mean, ...).

    With `proxy` ((texts, items) -> rewards: the run's training reward when it is learned), the same
    completions' mean proxy reward is eval/proxy_reward, beside the gold eval/accuracy (single-turn).
    """
    if environment is not None:
        if max_model_len is None:
            raise ValueError("evaluate with an environment needs max_model_len (the engine's context, "
                             "rollout.max_model_len): a conversation's later turns are checked against it")
        return _evaluate_conversations(engine, tokenizer, items, environment, max_turns=max_turns, n=n, seed=seed,
                                       sampling=SimpleNamespace(temperature=temperature, top_p=1.0,
                                                                max_new_tokens=max_new_tokens,
                                                                max_model_len=max_model_len),
                                       samples=samples, max_samples=max_samples)
    prompts = [encode_prompt(tokenizer, it.prompt) for it in items]
    out = engine.generate(prompts, n=n, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens,
                          seed=seed, logprobs=False)
    # The engine returns the n completions of each prompt next to each other.
    correct = [is_correct(t, items[k // n]) for k, t in enumerate(out.texts)]
    lengths = [len(c) for c in out.completion_ids]
    wrong = [m for m, ok in zip(lengths, correct) if not ok]
    if samples is not None:
        samples.extend({"prompt": items[k // n].prompt, "completion": out.texts[k], "answer": items[k // n].answer,
                        "correct": bool(correct[k])} for k in range(min(max_samples, len(out.texts))))
    proxied = {}
    if proxy is not None:
        rewards = proxy(out.texts, [items[k // n] for k in range(len(out.texts))])
        proxied["eval/proxy_reward"] = sum(rewards) / max(len(rewards), 1)
    return {"eval/accuracy": sum(correct) / max(len(items) * n, 1),
            "eval/completion_len_mean": sum(lengths) / max(len(lengths), 1),
            "eval/wrong_len_mean": sum(wrong) / len(wrong) if wrong else 0.0,
            "eval/n": float(len(items)), **proxied}


def _evaluate_conversations(engine, tokenizer, items: list, environment, *, max_turns: int, n: int, seed: int,
                            sampling, samples: list | None, max_samples: int) -> dict:
    """`evaluate` with an environment: n conversations per item, scored on their last answer."""
    out = multi_turn_rollout(engine, tokenizer, items, environment, group_size=n, max_turns=max_turns,
                             rollout_cfg=sampling, seed=seed, logprobs=False, greedy=sampling.temperature == 0.0)
    turn_correct = [[is_correct(a, items[k // n]) for a in t[0::2]] for k, t in enumerate(out.turns)]
    correct = [c[-1] for c in turn_correct]
    lengths = [sum(m) for m in out.loss_masks]            # the actor's tokens over all its turns
    wrong = [m for m, ok in zip(lengths, correct) if not ok]
    if samples is not None:
        samples.extend({"prompt": items[k // n].prompt, "completion": out.texts[k], "answer": items[k // n].answer,
                        "correct": bool(correct[k]), "turns": out.turns[k], "env_info": out.env_info[k]}
                       for k in range(min(max_samples, len(out.texts))))
    summary = conversation_metrics(turn_correct, prefix="eval/")
    # An environment that measures its replies (a tool: calls, errors) says so for the held-out conversations too.
    own = getattr(environment, "info_metrics", None)
    extra = {f"eval/{k}": v for k, v in own(out.env_info).items()} if callable(own) else {}
    return {"eval/accuracy": sum(correct) / max(len(items) * n, 1),
            "eval/completion_len_mean": sum(lengths) / max(len(lengths), 1),
            "eval/wrong_len_mean": sum(wrong) / len(wrong) if wrong else 0.0,
            "eval/n": float(len(items)),
            **{k: summary[k] for k in ("eval/first_acc", "eval/wrong_to_right", "eval/right_to_wrong",
                                          "eval/revision_gain")},
            **extra}


@dataclass
class Evaluator:
    """A run's held-out evaluation with its settings read once (RL loop and SFT control alike): greedy
    accuracy and lengths of `engine` on `items`, plus with `sampled_k` = k > 0 (trainer.eval_sampled_k)
    the mean accuracy of k samples per item at `temperature` (eval/sampled_accuracy, mean@k; DAPO reports
    avg@32), seeded by run seed and step so that rows of a table sharing a seed share the random numbers
    too. With a multi-turn `environment`, every item is a conversation of up to `max_turns` answers
    within `max_model_len` tokens."""

    engine: Any
    tokenizer: Any
    items: list
    max_new_tokens: int
    temperature: float
    sampled_k: int
    seed: int
    environment: Any = None
    max_turns: int = 1
    max_model_len: int | None = None
    proxy: Any = None   # (texts, items) -> training rewards, for eval/proxy_reward (a learned reward)

    @classmethod
    def of(cls, engine, tokenizer, items: list, *, rollout, trainer, interaction, seed: int,
           environment=None, proxy=None) -> "Evaluator":
        """From the run's rollout, trainer and interaction sections."""
        return cls(engine, tokenizer, items, max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                   sampled_k=trainer.eval_sampled_k, seed=seed, environment=environment,
                   max_turns=interaction.max_turns, max_model_len=rollout.max_model_len, proxy=proxy)

    def __call__(self, *, step: int, samples: list | None = None, max_samples: int = 0) -> dict:
        turns = ({"environment": self.environment, "max_turns": self.max_turns, "max_model_len": self.max_model_len}
                 if self.environment is not None else {})
        metrics = evaluate(self.engine, self.tokenizer, self.items, max_new_tokens=self.max_new_tokens,
                           samples=samples, max_samples=max_samples, proxy=None if turns else self.proxy, **turns)
        if self.sampled_k:
            sampled = evaluate(self.engine, self.tokenizer, self.items, max_new_tokens=self.max_new_tokens,
                               temperature=self.temperature, n=self.sampled_k, seed=self.seed * 1_000_003 + step,
                               **turns)
            metrics["eval/sampled_accuracy"] = sampled["eval/accuracy"]
        return metrics
