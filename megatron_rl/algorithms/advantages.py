"""Advantage estimators: GAE (needs a critic), GRPO and RLOO (baseline from sibling samples).

All of them produce ``[B, T]`` advantages that are exactly 0 at masked positions, so padding
can never leak into the policy loss.  They run without autograd: advantages are targets,
not something to differentiate through.  Scans run in float32 whatever the input dtype,
because bf16 accumulation over long responses drifts visibly.
"""

from __future__ import annotations

import torch

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo")
# Estimators whose baseline comes from the other samples of the same prompt (need rollout.n >= 2).
GROUP_ESTIMATORS = ("grpo", "rloo")


def needs_critic(name: str) -> bool:
    """True when the estimator needs a value model (only ``gae``)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return name == "gae"


@torch.no_grad()
def compute_gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation over valid tokens; returns ``(advantages, returns)``.

    The value after a row's last valid token is 0.  Masked positions are skipped: the next
    valid token's value and advantage are carried across them, so a gap changes nothing.
    ``returns = advantages + values``; both are 0 where ``mask`` is 0.  No whitening.
    """
    r, v = rewards.float(), values.float()
    m = mask.to(torch.float32)
    next_value = torch.zeros_like(v[:, 0])
    next_adv = torch.zeros_like(v[:, 0])
    adv = torch.zeros_like(v)
    for t in range(v.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        valid = m[:, t] > 0
        adv[:, t] = torch.where(valid, a_t, torch.zeros_like(a_t))
        next_value = torch.where(valid, v[:, t], next_value)
        next_adv = torch.where(valid, a_t, next_adv)
    returns = torch.where(m > 0, adv + v, torch.zeros_like(v))
    return adv, returns


@torch.no_grad()
def whiten(x, mask, shift_mean: bool = True, eps: float = 1e-8):
    """Normalise ``x`` to zero mean, unit variance over valid tokens; masked positions -> 0.

    Uses the population variance (divide by N): it is defined for a single token and differs
    from the unbiased estimate by a factor N/(N-1), negligible at batch sizes that matter.
    With ``shift_mean=False`` the original mean is added back (only the scale changes).
    """
    m = mask.to(torch.float32)
    xf = x.float()
    n = m.sum().clamp(min=1.0)
    mean = torch.where(m > 0, xf, torch.zeros_like(xf)).sum() / n
    centred = torch.where(m > 0, xf - mean, torch.zeros_like(xf))
    var = (centred * centred).sum() / n
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m > 0, out, torch.zeros_like(out))


def _group_stats(scores, group_index):
    """Per-sample group sum and size, gathered back to ``[B]``."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    sizes = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, torch.ones_like(scores)
    )
    return inverse, sums, sizes


def _check_scores(scores, group_index, mask):
    if scores.dim() != 1 or group_index.shape != scores.shape or mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"expected scores [B], group_index [B], mask [B, T]; got {tuple(scores.shape)}, "
            f"{tuple(group_index.shape)}, {tuple(mask.shape)}"
        )


@torch.no_grad()
def compute_grpo(scores, group_index, mask, norm_by_std: bool = True, eps: float = 1e-6):
    """GRPO: each sequence's score minus its group's mean, over the group's unbiased std.

    ``scores`` ``[B]`` is one reward per sequence; sequences sharing ``group_index`` come
    from the same prompt.  A group of one gets advantage 0.  Broadcast over ``mask`` ``[B, T]``.
    """
    _check_scores(scores, group_index, mask)
    s = scores.float()
    inverse, sums, sizes = _group_stats(s, group_index)
    mean = (sums / sizes)[inverse]
    adv = s - mean
    if norm_by_std:
        sq = torch.zeros_like(sums).index_add_(0, inverse, adv * adv)
        denom = (torch.sqrt(sq / (sizes - 1).clamp(min=1.0)) + eps)[inverse]
        adv = torch.where(denom > 0, adv / denom.clamp(min=torch.finfo(denom.dtype).tiny), torch.zeros_like(adv))
    return adv[:, None] * mask.to(torch.float32)


@torch.no_grad()
def compute_rloo(scores, group_index, mask):
    """RLOO: each score minus the mean of the *other* scores of its group, broadcast over ``mask``."""
    _check_scores(scores, group_index, mask)
    s = scores.float()
    inverse, sums, sizes = _group_stats(s, group_index)
    if bool((sizes < 2).any()):
        lone = torch.unique(group_index)[sizes < 2].tolist()
        raise ValueError(
            f"RLOO needs n >= 2 samples per prompt, but group(s) {lone} have a single sample; "
            "sample more responses per prompt or use grpo"
        )
    n = sizes[inverse]
    baseline = (sums[inverse] - s) / (n - 1)
    return (s - baseline)[:, None] * mask.to(torch.float32)
