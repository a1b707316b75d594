"""Rollout correction: importance weights between the rollout engine's and the trainer's policy.

The rollout engine samples with log-probs ``logp_rollout``; the trainer recomputes ``logp_old``
with its own kernels (and, with an external or asynchronous engine, possibly other weights).
When they differ, the PPO ratio ``pi / pi_old`` no longer corrects for where the samples came
from.  The per-token importance weight ``w_t = exp(logp_old - logp_rollout)`` (``level=token``)
or the sequence weight ``w = exp(sum_t (logp_old - logp_rollout))`` broadcast over the row
(``level=sequence``) restores it; its log is clamped to [-20, 20] against overflow.  With a
threshold ``C``:

* ``is`` (plain importance sampling): by ``w``, whatever its size (``C`` unused).  With
  ``algorithm.old_logprobs=recompute`` this is the decoupled PPO objective (Hilton et al. 2021,
  AReaL): the ratio is clipped against the proximal policy ``pi_old`` (the trainer's recompute)
  and ``w = pi_old / pi_rollout`` corrects for the behaviour policy that sampled;
* ``tis`` (truncated importance sampling): the loss of each token is multiplied by ``min(w, C)``;
* ``mis`` (masked importance sampling): by ``w`` where ``w <= C`` and by 0 where ``w > C`` (the
  token or the whole sequence drops out of the gradient but still counts in the denominator).

The weights are constants (no gradient), computed once per step on the host from the rollout
batch.  Modes are a registry: ``@register_correction("name")`` on
``fn(w, threshold) -> (applied_weight, affected)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_rl.config.choices import ROLLOUT_CORRECTION_LEVELS as LEVELS  # noqa: F401 - read here by users

_LOG_LIMIT = 20.0
CORRECTIONS: dict[str, Callable] = {}
MODES: dict[str, Callable] = {"auto": None, "off": None}  # what algorithm.rollout_correction.mode accepts


def register_correction(name: str, affected_metric: str):
    def decorate(fn: Callable) -> Callable:
        if name in MODES:
            raise ValueError(f"rollout correction {name!r} is already registered")
        fn.affected_metric = affected_metric
        CORRECTIONS[name] = MODES[name] = fn
        return fn

    return decorate


@register_correction("is", "above_threshold_frac")
def _is(w, threshold: float):
    """Plain IS: w (the share above C is logged, nothing is cut)."""
    return w, w > threshold


@register_correction("tis", "truncated_frac")
def _tis(w, threshold: float):
    """Truncated IS: min(w, C)."""
    return w.clamp(max=threshold), w > threshold


@register_correction("mis", "masked_frac")
def _mis(w, threshold: float):
    """Masked IS: w where w <= C, else 0."""
    affected = w > threshold
    return torch.where(affected, torch.zeros_like(w), w), affected


@torch.no_grad()
def correction_weights(old_logprob, rollout_logprob, mask, mode: str, level: str = "token", threshold: float = 2.0):
    """``(weights [B, T], metrics)``: the per-token loss multipliers (0 where masked) and their stats.

    Metrics (over valid tokens at token level, over non-empty sequences at sequence level):
    ``weight_mean`` and ``weight_max`` of the raw ``w``, ``truncated_frac`` (tis) or
    ``masked_frac`` (mis) -- the share with ``w > C`` -- and ``applied_mean``, the mean multiplier.
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; valid: {', '.join(CORRECTIONS)}")
    if level not in LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; valid: {', '.join(LEVELS)}")
    valid = mask > 0
    log_w = torch.where(valid, old_logprob.double() - rollout_logprob.double(), torch.zeros_like(old_logprob.double()))
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
        units = valid.any(-1)  # one unit per non-empty row
        pick = lambda x: x[:, 0][units]  # noqa: E731
    else:
        pick = lambda x: x[valid]  # noqa: E731
    w = torch.exp(log_w.clamp(-_LOG_LIMIT, _LOG_LIMIT))
    fn = CORRECTIONS[mode]
    applied, affected = fn(w, float(threshold))
    weights = torch.where(valid, applied, torch.zeros_like(applied)).float()
    raw, hit, used = pick(w), pick(affected), pick(applied)
    n = max(1, raw.numel())
    prefix = "rollout_correction/"
    metrics = {
        prefix + "weight_mean": float(raw.sum() / n),
        prefix + "weight_max": float(raw.max()) if raw.numel() else 0.0,
        prefix + fn.affected_metric: float(hit.double().sum() / n),
        prefix + "applied_mean": float(used.sum() / n),
    }
    return weights, metrics
