"""Rewards for PPO rollouts: built-in verifiable math rewards and a registry for user functions.

``reward.fn`` in the config names a registered reward (``math_answer``, ``gsm8k``, ``math_verify``,
``exact_match``, ``format``, ``math_answer_with_format``) or an import path ``package.module:function``;
:func:`compute_rewards` calls it and checks what it returns.  docs/rewards.md describes the graders.

Importing this package does not import torch (the registry imports it when it first checks
rewards): the grading worker process imports these modules and must start in a fraction of a second.
"""

from megatron_rl.rewards.bounded import Scores, bounded_map
from megatron_rl.rewards.compare import answers_match
from megatron_rl.rewards.extract import extract_answer, final_answer, reference_answer
from megatron_rl.rewards.format import format_reward, has_final_answer, math_answer_with_format
from megatron_rl.rewards.graders import is_correct
from megatron_rl.rewards.math_answer import exact_match, math_answer, math_verify
from megatron_rl.rewards.numbers import parse_number
from megatron_rl.rewards.registry import (
    Graded,
    RewardFunctionError,
    compute_rewards,
    get_reward_fn,
    grade_batch,
    grader,
    list_rewards,
    register_grader,
    register_reward,
    reward_name,
)

__all__ = [
    "Graded", "RewardFunctionError", "compute_rewards", "get_reward_fn", "grade_batch", "grader", "list_rewards",
    "register_grader", "register_reward", "reward_name",
    "answers_match", "exact_match", "extract_answer", "final_answer", "is_correct", "math_answer", "math_verify",
    "parse_number", "reference_answer",
    "format_reward", "has_final_answer", "math_answer_with_format",
    "Scores", "bounded_map",
]
