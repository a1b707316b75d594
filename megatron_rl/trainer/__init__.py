"""The PPO loop: rollout, rewards, experience, actor/critic updates, checkpoints, metrics."""
