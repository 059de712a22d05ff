"""The contract every training objective fulfils, and the registry that holds them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_lab.registry import Registry
from grpo_lab.schema import as_dict

# name -> Objective instance (algorithm.objective).
OBJECTIVES = Registry("training objective")


def settings_of(section) -> dict:
    """A config section as plain keyword arguments for ``Registry.call`` (which passes each registered
    function only the ones its signature names)."""
    return as_dict(section)


@dataclass(frozen=True)
class LearnerNeeds:
    """What an objective needs the learner to hold and compute, stated once when the learner is built
    (`Objective.needs`), so the learner never asks again: per minibatch it calls only
    `Objective.minibatch_plan` (which rows train, and the normalisers) and, per micro-batch, `loss`."""

    reference: bool                        # a frozen copy of the starting policy (π_ref)
    critic: bool                           # a value model trained beside the policy (PPO)
    # None: `loss` gets the policy's logprobs of the micro-batch's own rows [n, T] (and the learner may
    # read π_learner from that forward); a tuple of names: of each view "<name>/" ({name: [n, T]}).
    views: tuple[str, ...] | None
    entropy: bool                          # the token entropy of the own rows is computed (and logged)
    entropy_grad: bool                     # ... on the autograd graph (a loss term differentiates it)


@dataclass(frozen=True)
class MinibatchPlan:
    """Per minibatch: rows whose loss and gradient are exactly 0 (bool [m]) and the minibatch-wide
    normalisers the objective's `loss` needs beyond the learner's own (num_tokens, num_seqs, max_len)."""

    without_gradient: torch.Tensor
    norms: dict


class Objective:
    """Defaults shared by the objectives; each subclass overrides what makes it what it is.

    Every method receives plain config sections (``algo`` = ``cfg.algorithm``) and tensors; none
    keeps state, so one registered instance serves every run.
    """

    # The rows the learner runs the policy on (with gradient) before calling `loss`. None: the
    # micro-batch's own rows; `loss` gets logprobs and ref_logprobs [n, T]. A tuple of names: the
    # micro-batch's views "<name>/" (e.g. a preference pair's "chosen" and "rejected" completions);
    # `loss` gets {name: [n, T]} for each. With None the learner may also read π_learner from that
    # forward instead of a scoring forward of its own (Learner.learner_logprobs_from_update).
    views: tuple[str, ...] | None = None
    # Whether `loss` reports the token entropy of the micro-batch's own rows (views None): the
    # learner then computes it, off the autograd graph unless `entropy_in_loss`.
    logs_entropy = False
    # The algorithm.* settings (dotted prefixes) that only this objective reads: under another objective
    # they are refused when set (grpo_lab/config_reads.py). Settings every objective reads are not listed.
    only_reads: tuple[str, ...] = ()

    def entropy_in_loss(self, algo) -> bool:
        """Whether `loss` differentiates through the token entropy (an entropy bonus)."""
        return False

    def needs_reference(self, algo) -> bool:
        """Whether the learner must hold a frozen copy of the starting policy (loaded only then)."""
        return algo.kl.coef > 0 or bool(algo.kl.track)

    def needs_critic(self, algo) -> bool:
        """Whether the learner must train a value model."""
        return bool(algo.critic.enabled)

    def min_group_size(self, algo) -> int:
        """Fewest samples per prompt with which this objective can learn anything."""
        return 1

    def needs(self, algo) -> LearnerNeeds:
        """Everything the learner must know about this objective under `algo`, read once."""
        in_loss = self.entropy_in_loss(algo)
        return LearnerNeeds(reference=self.needs_reference(algo), critic=self.needs_critic(algo), views=self.views,
                            entropy=self.views is None and (self.logs_entropy or in_loss), entropy_grad=in_loss)

    def for_run(self, algo) -> Objective:
        """This objective for one run's `algo`: what `algo` names (registered functions and their settings)
        resolved once, for the learner and the loop, which call it every step with that same section. By
        default there is nothing to resolve; the registered instance serves as it is."""
        return self

    def minibatch_plan(self, minibatch, algo) -> MinibatchPlan:
        """The minibatch's rows without gradient and its normalisers (`rows_without_gradient`, `minibatch_norms`)."""
        return MinibatchPlan(self.rows_without_gradient(minibatch, algo), self.minibatch_norms(minibatch))

    def check(self, cfg, errors: list[str]) -> None:
        """Append a message (naming the key and what to change) for every setting that cannot work."""

    def make_sampler(self, cfg, engine, tokenizer, train_items: list, environment=None):
        """Where a step's sequences come from: by default the engine's groups of G samples per prompt
        (G conversations per prompt with a multi-turn `environment`, grpo_lab.interaction)."""
        from grpo_lab.sampling import GroupSampler, PromptStream

        return GroupSampler(engine, tokenizer, PromptStream(train_items, cfg.seed), cfg, seed=cfg.seed,
                            environment=environment)

    def prepare(self, batch, algo, *, normalizer, step: int, seed: int = 0):
        """Scored ``TensorBatch`` -> (the batch this objective trains on, metrics). ``seed`` (the run's)
        and ``step`` seed any noise the objective draws, so a resumed run draws the same."""
        raise NotImplementedError

    def minibatch_norms(self, minibatch) -> dict:
        """Minibatch-wide normalisers beyond the learner's own (num_tokens, num_seqs, max_len), so that
        summing micro-batch losses gives exactly the full minibatch's loss."""
        return {}

    def rows_without_gradient(self, minibatch, algo):
        """Bool [n]: rows whose contribution to `loss` and its gradient is exactly 0 whatever the policy's
        weights, given the minibatch-wide normalisers (`minibatch_norms` and the learner's, computed
        over all rows). The learner may leave them out of the forward/backward
        (learner.skip_rows_without_gradient). By default none: an objective says when it knows better."""
        return torch.zeros(len(minibatch), dtype=torch.bool)

    def loss(self, micro, *, logprobs, entropy=None, ref_logprobs=None, norm: dict, algo):
        """(loss whose gradient is accumulated, metrics) for one micro-batch ``micro`` (a ``TensorBatch``
        of what ``prepare`` made). ``logprobs``: the policy's token logprobs with gradient (shaped as
        ``views`` says); ``entropy`` [n, T] or None (``logs_entropy``); ``ref_logprobs``: the
        reference's, or None without one; ``norm``: the minibatch-wide normalisers (``num_tokens``,
        ``num_seqs``, ``max_len`` and ``minibatch_norms``')."""
        raise NotImplementedError

    def run_name_knobs(self, algo) -> str:
        """The settings a run name shows after algorithm and G, e.g. "clip0.2_kl0"."""
        raise NotImplementedError
