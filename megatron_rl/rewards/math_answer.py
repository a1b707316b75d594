"""Verifiable math rewards: is the response's final answer equal to the reference?

``math_answer`` (alias ``gsm8k``) extracts the final answer (``#### x`` or the last group of
``\\boxed{x}``, :mod:`megatron_rl.rewards.extract`) and compares it exactly
(:mod:`megatron_rl.rewards.compare`).  ``math_verify`` uses the same extraction and math-verify's
symbolic comparison (the ``.[math]`` extra, :mod:`megatron_rl.rewards.symbolic`).  Both grade each
sample in a worker process bounded by ``timeout_s`` (``reward.timeout_s``).
"""

from __future__ import annotations

from megatron_rl.rewards.compare import answers_match  # noqa: F401  (re-exported)
from megatron_rl.rewards.extract import extract_answer, reference_answer  # noqa: F401  (re-exported)
from megatron_rl.rewards.graders import is_correct, score_math_answer  # noqa: F401  (re-exported)
from megatron_rl.rewards.numbers import parse_number  # noqa: F401  (re-exported)
from megatron_rl.rewards.registration import batch_reward, register_reward
from megatron_rl.rewards.symbolic import score_math_verify

math_answer = register_reward("math_answer", "gsm8k")(batch_reward(score_math_answer, "math_answer", __name__))
math_verify = register_reward("math_verify")(batch_reward(score_math_verify, "math_verify", __name__))


@register_reward("exact_match")
def exact_match(prompts, responses, answers, **kwargs) -> list[float]:
    """1.0 where the whole response equals the reference after strip and casefold, else 0.0."""
    return [1.0 if a is not None and r.strip().casefold() == str(a).strip().casefold() else 0.0
            for r, a in zip(responses, answers)]
