"""Advantage estimators, one registry entry each: GAE (critic), GRPO, Dr.GRPO, RLOO, REINFORCE++.

All of them produce ``[B, T]`` advantages that are exactly 0 at masked positions, so padding
can never leak into the policy loss.  They run without autograd: advantages are targets,
not something to differentiate through.  Scans run in float32 whatever the input dtype,
because bf16 accumulation over long responses drifts visibly; group statistics run in float64
around a per-group reference, so a group whose rewards are all equal gets exactly 0.

Adding an estimator is one decorated function in this file::

    @register_advantage("my_estimator", needs_groups=True)
    def _my_estimator(batch: AdvantageBatch, opts):
        \"\"\"One line for the feature matrix and the docs.\"\"\"
        return advantages, None          # [B, T] (0 where masked), returns (GAE only) or None

The config schema (``algorithm.advantage``), validation (``needs_groups`` -> ``rollout.n >= 2``),
the trainer (``needs_critic`` -> a value model) and the feature matrix read this registry.
``opts`` is the :class:`~megatron_rl.config.schema.AlgorithmConfig` (any object with its fields).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: Callable
    needs_critic: bool  # the trainer builds and trains a value model
    needs_groups: bool  # the baseline comes from the other samples of a prompt: rollout.n >= 2
    summary: str


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(name: str, *, needs_critic: bool = False, needs_groups: bool = False):
    """Register ``fn(batch: AdvantageBatch, opts) -> (advantages [B, T], returns or None)`` as ``name``."""

    def decorate(fn: Callable) -> Callable:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(name, fn, needs_critic, needs_groups, summary)
        return fn

    return decorate


def get_estimator(name: str) -> AdvantageEstimator:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def needs_critic(name: str) -> bool:
    """True when the estimator needs a value model."""
    return get_estimator(name).needs_critic


def needs_groups(name: str) -> bool:
    """True when the estimator's baseline comes from sibling samples (needs rollout.n >= 2)."""
    return get_estimator(name).needs_groups


@dataclasses.dataclass
class AdvantageBatch:
    """What an estimator may read.  ``token_rewards`` ``[B, T]`` already carries the KL penalty when
    ``algorithm.kl_in_reward`` is on; outcome estimators use its masked row sums (:meth:`returns`)."""

    token_rewards: torch.Tensor
    mask: torch.Tensor
    group_index: torch.Tensor  # [B]: samples with the same value come from the same prompt
    values: Optional[torch.Tensor] = None  # [B, T] critic values (GAE)

    def sequence_returns(self) -> torch.Tensor:
        """``[B]`` sum of the (penalised) token rewards over valid tokens, float32.

        Without a KL penalty this is the sequence score exactly (one non-zero term per row)."""
        r = self.token_rewards.float()
        return torch.where(self.mask > 0, r, torch.zeros_like(r)).sum(-1)


# ---------------------------------------------------------------------------- building blocks


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
def discounted_returns(rewards, mask, gamma: float):
    """``G_t = r_t + gamma * G_{t+1}`` over valid tokens (masked positions skipped, 0 there)."""
    r = rewards.float()
    m = mask.to(torch.float32)
    running = torch.zeros_like(r[:, 0])
    out = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        valid = m[:, t] > 0
        g_t = r[:, t] + gamma * running
        out[:, t] = torch.where(valid, g_t, torch.zeros_like(g_t))
        running = torch.where(valid, g_t, running)
    return out


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


def _check_scores(scores, group_index, mask):
    if scores.dim() != 1 or group_index.shape != scores.shape or mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"expected scores [B], group_index [B], mask [B, T]; got {tuple(scores.shape)}, "
            f"{tuple(group_index.shape)}, {tuple(mask.shape)}"
        )


class _Groups:
    """Group statistics in float64 around each group's smallest score.

    ``centred = score - min(group)`` is exactly 0 for every member of an all-equal group, so its
    sum, mean, deviations and std are exactly 0 too: no rounding residue can be amplified by the
    division by a (near-)zero std.  Other groups lose nothing: float64 holds a float32 difference
    exactly.
    """

    def __init__(self, scores, group_index):
        ids, self.inverse = torch.unique(group_index, return_inverse=True)
        self.ids = ids
        n = int(ids.numel())
        s = scores.double()
        low = torch.full((n,), float("inf"), dtype=torch.float64, device=s.device)
        low = low.scatter_reduce(0, self.inverse, s, reduce="amin", include_self=True)
        self.centred = s - low[self.inverse]
        self.sizes = torch.zeros(n, dtype=torch.float64, device=s.device).index_add_(
            0, self.inverse, torch.ones_like(s))
        self.sums = torch.zeros(n, dtype=torch.float64, device=s.device).index_add_(0, self.inverse, self.centred)

    def size(self):
        return self.sizes[self.inverse]

    def minus_mean(self):
        return self.centred - (self.sums / self.sizes)[self.inverse]

    def unbiased_std(self, deviations):
        sq = torch.zeros_like(self.sums).index_add_(0, self.inverse, deviations * deviations)
        return torch.sqrt(sq / (self.sizes - 1).clamp(min=1.0))[self.inverse]


@torch.no_grad()
def compute_grpo(scores, group_index, mask, norm_by_std: bool = True, eps: float = 1e-6):
    """GRPO: each sequence's score minus its group's mean, over the group's unbiased std (+ eps).

    ``scores`` ``[B]`` is one reward per sequence; sequences sharing ``group_index`` come
    from the same prompt.  A group of one, or whose scores are all equal, gets exactly 0.
    Broadcast over ``mask`` ``[B, T]``.
    """
    _check_scores(scores, group_index, mask)
    groups = _Groups(scores, group_index)
    adv = groups.minus_mean()
    if norm_by_std:
        denom = groups.unbiased_std(adv) + eps
        adv = torch.where(denom > 0, adv / denom.clamp(min=torch.finfo(denom.dtype).tiny), torch.zeros_like(adv))
    return adv.float()[:, None] * mask.to(torch.float32)


@torch.no_grad()
def compute_rloo(scores, group_index, mask):
    """RLOO: each score minus the mean of the *other* scores of its group, broadcast over ``mask``."""
    _check_scores(scores, group_index, mask)
    groups = _Groups(scores, group_index)
    if bool((groups.sizes < 2).any()):
        lone = groups.ids[groups.sizes < 2].tolist()
        raise ValueError(
            f"RLOO needs n >= 2 samples per prompt, but group(s) {lone} have a single sample; "
            "sample more responses per prompt or use grpo"
        )
    n = groups.size()
    baseline = (groups.sums[groups.inverse] - groups.centred) / (n - 1)
    return (groups.centred - baseline).float()[:, None] * mask.to(torch.float32)


# ---------------------------------------------------------------------------- the registry


@register_advantage("gae", needs_critic=True)
def _gae(batch: AdvantageBatch, opts):
    """PPO with a critic: GAE(gamma, lam) on the token rewards, optionally whitened over the batch."""
    advantages, returns = compute_gae(batch.token_rewards, batch.values, batch.mask, opts.gamma, opts.lam)
    if opts.whiten_advantages:
        advantages = whiten(advantages, batch.mask)
    return advantages, returns


@register_advantage("grpo", needs_groups=True)
def _grpo(batch: AdvantageBatch, opts):
    """GRPO: (R - mean of the group) / (unbiased std of the group + 1e-6), R the sequence's return."""
    return compute_grpo(batch.sequence_returns(), batch.group_index, batch.mask, norm_by_std=opts.norm_by_std), None


@register_advantage("rloo", needs_groups=True)
def _rloo(batch: AdvantageBatch, opts):
    """RLOO: R minus the mean return of the other samples of the same prompt."""
    return compute_rloo(batch.sequence_returns(), batch.group_index, batch.mask), None


@register_advantage("drgrpo", needs_groups=True)
def _drgrpo(batch: AdvantageBatch, opts):
    """Dr.GRPO: R minus the group mean, no std normalisation (pair with loss_agg=seq-mean-token-sum-norm)."""
    return compute_grpo(batch.sequence_returns(), batch.group_index, batch.mask, norm_by_std=False), None


@register_advantage("reinforce_plus_plus")
def _reinforce_plus_plus(batch: AdvantageBatch, opts):
    """REINFORCE++: discounted reward-to-go of the (KL-penalised) token rewards, whitened over the batch."""
    returns = discounted_returns(batch.token_rewards, batch.mask, opts.gamma)
    return whiten(returns, batch.mask), None


@register_advantage("reinforce_plus_plus_baseline", needs_groups=True)
def _reinforce_plus_plus_baseline(batch: AdvantageBatch, opts):
    """REINFORCE++-baseline: R minus the group mean, broadcast over tokens, whitened over the batch."""
    centred = compute_grpo(batch.sequence_returns(), batch.group_index, batch.mask, norm_by_std=False)
    return whiten(centred, batch.mask), None


def compute(name: str, batch: AdvantageBatch, opts):
    """Run the registered estimator ``name``; returns ``(advantages, returns or None)``."""
    estimator = get_estimator(name)
    if estimator.needs_critic and batch.values is None:
        raise ValueError(f"advantage estimator {name!r} needs critic values")
    return estimator.fn(batch, opts)
