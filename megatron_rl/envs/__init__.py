"""Multi-turn environments: the protocol users implement, the built-in tool-calling environment,
its tools (run bounded, in worker processes), and the rollout that drives trajectories through a
rollout engine token-in-token-out (:mod:`megatron_rl.envs.trajectories`)."""
