"""Pure RL post-training math: tensors in, tensors + metrics out (no config, no I/O, no state).
The policy-gradient step's math is core.py, read top to bottom; each other module is one concept.

One registry per concept; dispatch by name only through them:

    ADVANTAGE_ESTIMATORS  group_zscore, group_mean, group_mean_batch_std, rloo, reinforce_pp, gae
    POLICY_LOSSES         clipped_surrogate, gspo, gspo_token, vanilla_pg, cispo, gmpo, sapo, dppo
    KL_ESTIMATORS         k1, k2, k3
    AGGREGATIONS          token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm
    PREFERENCE_LOSSES     dpo, ipo
    PAIRINGS              best_worst, all_pairs
    RANKING_LOSSES        bradley_terry, plackett_luce   (reward models: scalar scores of ranked completions)
    ROLLOUT_CORRECTION_LEVELS  token, sequence, geometric    (engine/learner mismatch weights)
    ROLLOUT_CORRECTION_MODES   truncate, mask
"""

from .core import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    best_of_group_mask,
    cispo,
    clipped_surrogate,
    dppo,
    ema_reward_normalize,
    entropy_from_logits,
    gae,
    gmpo,
    group_mean,
    group_mean_batch_std,
    group_stats,
    group_zscore,
    gspo,
    gspo_token,
    informative_group_mask,
    linear_warmup,
    log_ratio_stats,
    reinforce_pp,
    rloo,
    sapo,
    soft_overlong_penalty,
    token_mean,
    vanilla_pg,
)
from .kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3
from .preference import (
    PAIRINGS,
    PREFERENCE_LOSSES,
    best_worst_pairs,
    dpo_loss,
    group_preference_pairs,
    ipo_loss,
    sequence_logps,
)
from .ranking import RANKING_LOSSES, adjacent_pair_mask, bradley_terry_loss, plackett_luce_loss
from .rollout_correction import (
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    effective_sample_size,
    logprob_mismatch_metrics,
    rollout_correction_weights,
)
from .value_losses import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "PAIRINGS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "RANKING_LOSSES", "adjacent_pair_mask",
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "aggregate",
    "bradley_terry_loss",
    "cispo",
    "plackett_luce_loss",
    "best_of_group_mask",
    "clipped_surrogate",
    "clipped_value_loss",
    "dpo_loss",
    "dppo",
    "effective_sample_size",
    "ema_reward_normalize",
    "entropy_from_logits",
    "gae",
    "gmpo",
    "group_mean",
    "group_mean_batch_std",
    "group_preference_pairs",
    "best_worst_pairs",
    "group_stats",
    "group_zscore",
    "gspo",
    "gspo_token",
    "informative_group_mask",
    "ipo_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "linear_warmup",
    "log_ratio_stats",
    "logprob_mismatch_metrics",
    "reinforce_pp",
    "rloo",
    "rollout_correction_weights",
    "sapo",
    "sequence_logps",
    "soft_overlong_penalty",
    "token_mean",
    "vanilla_pg",
]
