"""On-policy distillation's per-token advantage and its reverse-KL metric.

The student samples; a frozen teacher scores each sampled token.  With ``s`` and ``t`` the
student's and the teacher's log-probs of the sampled token, ``t - s`` is a one-sample estimate of
``-KL(student || teacher)`` at that position, so using it as the token's advantage in the policy
gradient minimises the reverse KL on the student's own trajectories (no baseline needed: its
expectation under the student is the KL itself).  ``reward_coef`` mixes in the task advantage.
Tokens outside ``mask`` (prompt, padding, observations of multi-turn trajectories) carry none.

``baseline="batch_mean"`` subtracts the mean of ``t - s`` over the batch's tokens first.  A constant
leaves the expected gradient alone (the expected score ``E[grad log p]`` is 0; the batch's own mean
adds a bias of order 1/tokens, as GRPO's group mean does), but it removes the large common offset:
while the student is far from the teacher nearly every sampled token has ``t - s`` well below 0, so
the plain estimator mostly pushes down whatever was sampled and the little that tells the right
token from the wrong ones is lost in that noise (measured in docs/distillation.md).
"""

from __future__ import annotations

import torch


def distill_advantages(task_advantages: torch.Tensor, student_logprob: torch.Tensor,
                       teacher_logprob: torch.Tensor, mask: torch.Tensor, coef: float,
                       reward_coef: float, baseline: str = "none") -> torch.Tensor:
    """``[B, R]``: ``coef * (teacher - student - b) + reward_coef * task_advantages`` on ``mask``, 0
    elsewhere; ``b`` is 0 (``none``) or the mean of ``teacher - student`` over ``mask`` (``batch_mean``)."""
    gap = (teacher_logprob - student_logprob) * mask
    if baseline == "batch_mean":
        gap = gap - gap.sum() / mask.sum().clamp(min=1)
    elif baseline != "none":
        raise ValueError(f"unknown distillation baseline {baseline!r}")
    return (coef * gap + reward_coef * task_advantages) * mask


def reverse_kl(student_logprob: torch.Tensor, teacher_logprob: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``student - teacher`` over the tokens in ``mask``: the k1 estimate of
    KL(student || teacher) per sampled token (0.0 when ``mask`` is empty)."""
    count = mask.sum()
    if count == 0:
        return 0.0
    return float(((student_logprob - teacher_logprob) * mask).sum() / count)


def uses_task_advantage(alg) -> bool:
    """Whether the step computes the task advantage (``algorithm.advantage`` over the reward): always
    without distillation; with it only when ``reward_coef`` > 0 (pure distillation needs no critic)."""
    return not alg.distill.teachers or alg.distill.reward_coef > 0
