"""Reward ``reward_model`` registered where its models live: the trained reward models score the batch, a run
trains them before its first step (the entry's ``prepare`` fact) and may keep training them online (its
``online`` fact). The scoring rules (ensemble, normalisation, clip) and the settings' checks are
grpo_lab/rewards/reward_model.py's; training is reward_model_training.py's; the online refresh
reward_refresh.py's.

Each reward-model directory is loaded once per process and kept (reward_model.loaded_reward_model); nothing here steps
an optimizer except an online refresh, which reloads fresh copies at its start and drops them at its end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from grpo_lab.rewards import REWARDS, RewardValues
from grpo_lab.rewards.reward_model import check_reward_model_reward, combine_members, normalize_scores
from grpo_lab.second_models.reward_model import loaded_reward_model

def prepare_reward_models(cfg, start) -> dict | None:
    """With no reward.reward_model.dirs, the reward models the top-level `reward_model` section describes,
    trained on the starting policy's labelled samples (or its preference file) and named in the reward's
    settings; their training stats (None when the run names trained ones)."""
    if cfg.reward.reward_model.dirs is not None:
        return None
    from grpo_lab.second_models.reward_model_training import build_reward_models

    dirs, stats = build_reward_models(cfg, start)
    cfg.reward.reward_model.dirs = [str(d) for d in dirs]
    return {k: v for k, v in stats.items() if k != "members"}


def online_refresh(cfg):
    """The online refresh of the run's reward models (reward_model.refresh_every > 0), else None."""
    if not cfg.reward_model.refresh_every:
        return None
    from grpo_lab.second_models.reward_refresh import RewardRefresh

    return RewardRefresh(cfg.reward.reward_model.dirs, cfg.reward_model, cfg.reward, seed=cfg.seed)


@REWARDS.register("reward_model", check=check_reward_model_reward, may_hang=False, prepare=prepare_reward_models,
                  online=online_refresh)
def reward_model_reward(completions: list[str], *, prompt: list[str], reward_model: Mapping[str, Any],
                        **_: Any) -> RewardValues:
    """The learned reward of each completion (grpo_lab/rewards/reward_model.py's rules), with the raw member
    mean (and the members' std for an ensemble) in ``info``."""
    dirs = reward_model["dirs"]
    if not dirs:
        raise RuntimeError("reward.reward_model.dirs is empty: a run trains its reward models before the first "
                           "step; a reward call outside a run must name them")
    members = [loaded_reward_model(d, str(reward_model["dtype"])) for d in dirs]
    batch = int(reward_model["batch_size"])
    scores = torch.tensor([m.scores(prompt, completions, batch_size=batch) for m in members], dtype=torch.float32)
    values = combine_members(scores, str(reward_model["ensemble"]), float(reward_model["ensemble_std_coef"]))
    values = normalize_scores(values, str(reward_model["normalize"]), prompt)
    if reward_model["clip"] is not None:
        values = values.clamp(-float(reward_model["clip"]), float(reward_model["clip"]))
    info = {"raw": scores.mean(0).tolist()}
    if len(members) > 1:
        info["std"] = scores.std(0, unbiased=False).tolist()
    return RewardValues(values.tolist(), info=info)
