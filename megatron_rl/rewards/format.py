"""Format rewards: a small bonus for ending with an answer the grader can find.

Early in training a policy often computes the right number but never states it in an extractable
form, so :func:`math_answer` pays nothing and there is no signal to learn from.  A small weight on
format gives that signal without outweighing correctness: by default
``0.9 * correct + 0.1 * well_formed``, so a correct answer scores at least 0.9 and a well-formed
wrong one 0.1.  Both weights are keyword arguments of :func:`math_answer_with_format`.
"""

from __future__ import annotations

from megatron_rl.rewards.math_answer import is_correct, last_boxed, last_hashes, parse_number
from megatron_rl.rewards.registry import register_reward

CORRECT_WEIGHT = 0.9
FORMAT_WEIGHT = 0.1


def has_final_answer(response: str) -> bool:
    """True if ``response`` ends with ``#### <number>`` or contains a non-empty ``\\boxed{...}``."""
    hashes = last_hashes(response)
    if hashes is not None:
        pos, rest = hashes
        if "\n" not in response[pos:].rstrip() and parse_number(rest) is not None:
            return True
    boxed = last_boxed(response)
    return boxed is not None and boxed[1].strip() != ""


@register_reward("format")
def format_reward(prompts, responses, answers, **kwargs) -> list[float]:
    """1.0 where the response has a well-formed final answer (see :func:`has_final_answer`)."""
    return [1.0 if has_final_answer(r) else 0.0 for r in responses]


@register_reward("math_answer_with_format")
def math_answer_with_format(prompts, responses, answers, correct_weight: float = CORRECT_WEIGHT,
                            format_weight: float = FORMAT_WEIGHT, **kwargs) -> list[float]:
    """``correct_weight * correct + format_weight * well_formed`` (defaults 0.9 and 0.1)."""
    return [correct_weight * float(is_correct(r, a)) + format_weight * float(has_final_answer(r))
            for r, a in zip(responses, answers)]
