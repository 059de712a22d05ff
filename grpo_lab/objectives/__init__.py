"""Training objectives: one file per objective, each registered once in ``OBJECTIVES``.

An objective owns its whole contract:

* what it needs — a frozen reference, a critic, at least G samples per prompt (``needs_reference``,
  ``needs_critic``, ``min_group_size``), and its own config checks (``check``), which ``validate()``
  asks for instead of keeping lists of names;
* which models the learner holds and which forwards it runs for its loss, stated once as a
  ``LearnerNeeds`` (``needs``: reference, critic, ``views``, entropy); per minibatch the learner asks
  only for a ``MinibatchPlan`` (rows without gradient, normalisers) and per micro-batch for the ``loss``;
* where a step's sequences come from (``make_sampler``);
* how a scored batch becomes its training input (``prepare``: advantages, or preference pairs);
* its loss on one micro-batch (``loss``: tensors in, loss and metrics out; it never calls the
  learner) and the minibatch-wide normalisers that loss needs;
* the settings its run names show (``run_name_knobs``).

    OBJECTIVES   policy_gradient (GRPO family, PPO, RLOO, REINFORCE++) | preference (DPO, IPO, group DPO)
"""

from grpo_lab.objectives.base import OBJECTIVES, LearnerNeeds, MinibatchPlan, Objective
from grpo_lab.objectives import policy_gradient, preference  # noqa: F401  (registers the objectives)

__all__ = ["OBJECTIVES", "LearnerNeeds", "MinibatchPlan", "Objective"]
