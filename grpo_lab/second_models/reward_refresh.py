"""Online refresh of learned reward models during RL: the current policy's samples, labelled by the gold
scorer, keep training the reward models the run optimises against (iterative / online RLHF: Llama 2's
iterative reward-model updates, arXiv 2307.09288 §3.2.2; Oat's online Bradley-Terry model, arXiv 2411.01493).

    RewardRefresh(dirs, rm_cfg, reward_cfg, *, seed)
        .after_step(step, texts, items, group_ids) -> metrics    every rm_cfg.refresh_every steps
        .state_dict() / .load_state_dict(state)                   weights and optimizer, in the run's checkpoints
        .close()                                                  the refreshed copies are dropped with the run

The members are the very objects reward=reward_model scores with (reward_model.loaded_reward_model keeps one per
directory in this process), so an update is seen by the next reward call. The pairs of a refresh are drawn
from the step's groups (pairs of distinct completions of one prompt with different gold scores,
grpo_lab.second_models.preference_data), by a generator seeded by run seed and step: a resumed run draws
the same pairs. The optimizer starts fresh at the first refresh (a saved reward model keeps no optimizer state)
at reward_model.lr, and then lives in the checkpoints.
"""

from __future__ import annotations

import random

from grpo_lab.rewards import compute_rewards, contained_settings
from grpo_lab.second_models.reward_model import forget_reward_model, loaded_reward_model
from grpo_lab.second_models.preference_data import groups_from_scores, swap_labels


class RewardRefresh:
    def __init__(self, dirs, rm_cfg, reward_cfg, *, seed: int):
        # Fresh from disk, and forgotten again at close(): a refreshed model must not outlive its run in a process
        # that runs several (a table's joblib worker), where the next run would score with it.
        for d in dirs:
            forget_reward_model(d)
        self.dirs = list(dirs)
        self.members = [loaded_reward_model(d) for d in dirs]
        for m in self.members:   # loaded frozen (lr 0): a refresh trains at the reward model's own rate
            for group in m.second.trainable.optimizer.param_groups:
                group["lr"] = rm_cfg.lr
        self.cfg, self.reward_cfg, self.seed = rm_cfg, reward_cfg, seed
        self.refreshes = 0

    def after_step(self, step: int, texts: list[str], items: list, group_ids: list[int]) -> dict[str, float]:
        """Every refresh_every steps: label up to refresh_pairs pairs of this step's samples by the gold reward
        and take refresh_steps ranking steps on each member; the refresh's metrics (none on other steps)."""
        cfg, data = self.cfg, self.cfg.data
        if step % cfg.refresh_every:
            return {}
        gold, _ = compute_rewards(texts, items, [(data.gold, 1.0)], **contained_settings(self.reward_cfg))
        by_group: dict[int, list[int]] = {}
        for i, g in enumerate(group_ids):
            by_group.setdefault(g, []).append(i)
        rng = random.Random(self.seed * 1_000_003 + step)
        groups = groups_from_scores([items[idx[0]].prompt for idx in by_group.values()],
                                    [[texts[i] for i in idx] for idx in by_group.values()],
                                    [[gold[i] for i in idx] for idx in by_group.values()],
                                    form=data.form, n=cfg.refresh_pairs, rng=rng, margin_scale=cfg.margin_scale)
        groups, _ = swap_labels(groups, data.label_noise, rng)
        if not groups:
            return {"reward_model/refresh_pairs": 0.0}
        self.refreshes += 1
        metrics: dict[str, float] = {}
        for member in self.members:
            for _ in range(cfg.refresh_steps):
                margins = [g.margin or 0.0 for g in groups] if any(g.margin for g in groups) else None
                metrics = member.ranking_step([(g.prompt, g.completions) for g in groups], loss=cfg.loss,
                                              margins=margins, micro_batch_size=cfg.micro_batch_size)
        # The last member's last step (its accuracy is on the pairs before that step: the proxy's error rate
        # on the current policy's samples, the quantity a refresh exists to keep low).
        return {**{k.replace("reward_model/", "reward_model/refresh_"): v for k, v in metrics.items()},
                "reward_model/refresh_pairs": float(len(groups)), "reward_model/refreshes": float(self.refreshes)}

    def close(self) -> None:
        for d in self.dirs:
            forget_reward_model(d)

    def state_dict(self) -> dict:
        return {"members": [m.second.state_dict() for m in self.members], "refreshes": self.refreshes}

    def load_state_dict(self, state: dict) -> None:
        for m, s in zip(self.members, state["members"]):
            m.second.load_state_dict(s)
        self.refreshes = state["refreshes"]
