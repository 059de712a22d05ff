"""grpo_lab: config-driven RL post-training experiments."""
