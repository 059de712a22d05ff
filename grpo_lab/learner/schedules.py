"""Learning-rate schedules: the multiplier of learner.lr for each RL step (one learner update each).

    warm-up (s < W):   f(s) = (s + 1) / W                    linear ramp; the first update already moves
    after warm-up:     p = (s − W) / (S − W)   (clamped to [0, 1])
        constant       f = 1
        cosine         f = ½ (1 + cos(π p))                  (SGDR, arXiv 1608.03983, without restarts)
        linear         f = 1 − p

s counts updates already applied (0 for the first), W = learner.warmup_steps, S = learner.total_steps.
The last update (s = S − 1) still has f > 0; f reaches 0 only after the schedule ends. One step of the
schedule is one RL step, not one optimizer step: with μ epochs × minibatches all of a step's
optimizer steps share its learning rate.
"""

from __future__ import annotations

import math

from grpo_lab.registry import Registry

# name -> f(progress in [0, 1]) after warm-up (learner.lr_schedule). Fact `decays`: f depends on progress,
# so learner.total_steps (the schedule's length) matters; a constant schedule does not read it.
LR_SCHEDULES = Registry("learning-rate schedule", defaults={"decays": True})


@LR_SCHEDULES.register("constant", decays=False)
def constant(progress: float) -> float:
    return 1.0


@LR_SCHEDULES.register("cosine")
def cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@LR_SCHEDULES.register("linear")
def linear(progress: float) -> float:
    return 1.0 - progress


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int | None) -> float:
    """Multiplier of the base learning rate for update number `step` (0-based); see the module docstring."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, (total_steps or 0) - warmup_steps)
    return LR_SCHEDULES.get(schedule)(min(1.0, max(0.0, (step - warmup_steps) / span)))
