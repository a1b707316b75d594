"""The rollout a config asks for: the engine itself, or driven by an environment or an agent."""

from __future__ import annotations

from megatron_rl.config.choices import ON_LIMIT_ZERO
from megatron_rl.envs.agent import AgentRollout
from megatron_rl.envs.base import environment_factory
from megatron_rl.envs.trajectories import EnvironmentRollout, TrajectoryLimits
from megatron_rl.resolve import trajectory_token_limit


def with_environment(cfg, engine, tokenizer):
    """``engine`` driven through ``rollout.env``'s trajectories or ``rollout.agent``'s sessions
    (``cfg`` resolved), or ``engine`` itself for single-turn rollouts."""
    r = cfg.rollout
    if not r.multi_turn:
        return engine
    limits = TrajectoryLimits(r.max_turns, trajectory_token_limit(cfg), r.on_limit == ON_LIMIT_ZERO)
    if r.agent:
        return AgentRollout(engine, tokenizer, r.agent, limits, r.agent_timeout_s)
    make_env = environment_factory(r.env, r.env_kwargs, defaults={"timeout_s": r.tool_timeout_s})
    return EnvironmentRollout(engine, make_env, tokenizer.encode, tokenizer.decode, limits)
