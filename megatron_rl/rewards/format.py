"""Format rewards: a small bonus for ending with an answer the grader can find.

Early in training a policy often computes the right number but never states it in an extractable
form, so :func:`math_answer` pays nothing and there is no signal to learn from.  A small weight on
format gives that signal without outweighing correctness: by default
``0.9 * correct + 0.1 * well_formed``, so a correct answer scores at least 0.9 and a well-formed
wrong one 0.1.  Both weights are keyword arguments of :func:`math_answer_with_format`.
"""

from __future__ import annotations

from megatron_rl.rewards.graders import (  # noqa: F401  (re-exported)
    CORRECT_WEIGHT,
    FORMAT_WEIGHT,
    has_final_answer,
    score_format,
    score_math_answer_with_format,
)
from megatron_rl.rewards.registration import batch_reward, register_reward

format_reward = register_reward("format")(batch_reward(score_format, "format_reward", __name__))
math_answer_with_format = register_reward("math_answer_with_format")(
    batch_reward(score_math_answer_with_format, "math_answer_with_format", __name__))
