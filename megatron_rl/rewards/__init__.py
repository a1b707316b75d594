"""Rewards for PPO rollouts: built-in verifiable math rewards and a registry for user functions.

``reward.fn`` in the config names a registered reward (``math_answer``, ``gsm8k``,
``exact_match``, ``format``, ``math_answer_with_format``) or an import path
``package.module:function``; :func:`compute_rewards` calls it and checks what it returns.
"""

from megatron_rl.rewards.registry import (
    RewardFunctionError,
    compute_rewards,
    get_reward_fn,
    list_rewards,
    register_reward,
    reward_name,
)
from megatron_rl.rewards.math_answer import exact_match, extract_answer, math_answer, parse_number
from megatron_rl.rewards.format import format_reward, has_final_answer, math_answer_with_format

__all__ = [
    "RewardFunctionError", "compute_rewards", "get_reward_fn", "list_rewards", "register_reward", "reward_name",
    "exact_match", "extract_answer", "math_answer", "parse_number",
    "format_reward", "has_final_answer", "math_answer_with_format",
]
