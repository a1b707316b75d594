"""Reward shaping on the sequence score, applied after the reward function and before advantages.

DAPO's overlong reward shaping: with the longest response ``L = rollout.max_new_tokens``, a buffer
of ``B`` tokens before it and a factor ``c``, a response of ``n`` tokens gets

    0                        if n <= L - B
    -c * (n - (L - B)) / B    if L - B < n <= L
    -c                       if n > L

added to its score: a soft, linearly growing penalty instead of a cliff at truncation.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths, max_new_tokens: int, buffer: int, factor: float) -> torch.Tensor:
    """``[B]`` penalties (<= 0) for responses of ``lengths`` tokens; all 0 when ``buffer`` is 0."""
    n = torch.as_tensor(lengths, dtype=torch.float32)
    if buffer <= 0:
        return torch.zeros_like(n)
    if buffer > max_new_tokens:
        raise ValueError(f"overlong buffer {buffer} is longer than max_new_tokens {max_new_tokens}")
    excess = (n - (max_new_tokens - buffer)).clamp(min=0.0)
    return -float(factor) * (excess / float(buffer)).clamp(max=1.0)
