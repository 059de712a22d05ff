"""Second models: every model other than the policy that the lab builds and trains beside it.

    base.SecondModel       the shared piece: a model with its own optimizer (grpo_lab.learner.trainable),
                           its SFT step (the warm-up's loop), its RL step (the policy-gradient objective the
                           actor trains with), its state for checkpoints and its own metric prefix
    critic_llm             the critic LLM that writes the actor's feedback (interaction=critic; metrics
                           under critic_llm/), registered in grpo_lab.interaction.ENVIRONMENTS
    reward_model           a reward model: a scalar head on any trunk, trained on ranked completions
                           (Bradley-Terry pairs, Plackett-Luce lists; metrics under reward_model/)
    reward_model_training  its data (preference_data), loop, held-out metrics and content-keyed cache
    learned_reward         the reward_model reward: scoring with trained reward models, registered in REWARDS
    reward_refresh         their online refresh on the policy's relabelled samples during RL

Each is built like the policy (grpo_lab.models.build_model_dir, cached warm-ups) and checkpointed with
the run; none writes an optimizer loop of its own.
"""

from grpo_lab.second_models import critic_llm  # noqa: F401  (registers the critic LLM environment)
from grpo_lab.second_models import learned_reward  # noqa: F401  (registers the reward_model reward)
from grpo_lab.second_models.base import SecondModel
from grpo_lab.second_models.reward_model import RewardModel

__all__ = ["RewardModel", "SecondModel", "critic_llm"]
