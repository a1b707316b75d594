"""Rewards of the built-in tasks (:mod:`megatron_rl.data.tasks`)."""

from __future__ import annotations

from megatron_rl.rewards.registration import register_reward


@register_reward("digit_sum")
def digit_sum(prompts, responses, answers, **kwargs) -> list[float]:
    """1.0 when the response, stripped, is exactly the answer's digits, else 0.0."""
    return [1.0 if answer is not None and response.strip() == str(answer).strip() else 0.0
            for response, answer in zip(responses, answers)]
