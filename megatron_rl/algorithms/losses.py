"""PPO policy/value losses split into ``(numerator, count)`` so one denominator can span the batch.

The engine cuts a mini-batch into micro-batches, data-parallel ranks and context-parallel
shards (each CP rank holds part of every sequence), then divides once by the global count.
That only equals the whole-batch loss if every piece returns a sum and a count that add up.
For the per-sequence modes a CP shard counts each row by the fraction of the row's tokens it
holds (``local_len / seq_len``), so the shards of a row sum to exactly one row.

Metrics are masked token means over valid tokens whatever ``agg`` is.  The ``*_parts``
functions return them as ``name -> tensor([sum, count])`` (detached) so they too can be
summed across pieces before dividing; the plain functions return the divided scalars.
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

_LOG_RATIO_LIMIT = 20.0


def _valid(mask):
    return mask > 0


def _masked(x, mask):
    """``x`` where mask is set, else 0; unlike ``x * mask`` this keeps NaN/inf in padding out."""
    return torch.where(_valid(mask), x, torch.zeros_like(x))


def _as_float(x):
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def aggregate_parts(loss_mat, mask, agg: str, seq_lengths=None):
    """``(numerator, count)`` of ``loss_mat`` ``[B, T]`` under ``agg``; numerator keeps the graph.

    token-mean: (sum of valid losses, valid tokens).  seq-mean-token-sum: (sum of row sums,
    rows).  seq-mean-token-mean: (sum of row sum / seq_len, rows).  ``seq_lengths`` ``[B]`` is
    each row's full valid length (default: ``mask.sum(-1)``); a row counts as
    ``local_len / seq_len`` rows, i.e. 1 for a whole row with a valid token, a fraction for a CP
    shard, 0 for an empty row.  ``count`` is a float32 tensor.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGG_MODES)}")
    loss = _masked(_as_float(loss_mat), mask)
    local_len = _valid(mask).sum(-1).to(torch.float32)
    if agg == "token-mean":
        return loss.sum(), local_len.sum()
    full_len = local_len if seq_lengths is None else seq_lengths.to(local_len.device, torch.float32)
    if full_len.shape != local_len.shape:
        raise ValueError(f"seq_lengths must be [B]={tuple(local_len.shape)}, got {tuple(full_len.shape)}")
    has_len = full_len > 0
    safe_len = torch.where(has_len, full_len, torch.ones_like(full_len))
    count = torch.where(has_len, local_len / safe_len, torch.zeros_like(full_len)).sum()
    row_sum = loss.sum(-1)
    if agg == "seq-mean-token-sum":
        return row_sum.sum(), count
    row_mean = torch.where(has_len, row_sum / safe_len.to(row_sum.dtype), torch.zeros_like(row_sum))
    return row_mean.sum(), count


def aggregate(loss_mat, mask, agg: str, seq_lengths=None, denominator=None):
    """Scalar loss: numerator / ``denominator`` if given, else / count (a zero count becomes 1)."""
    numerator, count = aggregate_parts(loss_mat, mask, agg, seq_lengths)
    return _divide(numerator, count, denominator)


def _token_stat(x, mask):
    """Detached ``tensor([sum over valid tokens, valid tokens])`` for cross-piece reduction."""
    x = _masked(x.detach().float(), mask)
    return torch.stack([x.sum(), _valid(mask).sum().to(torch.float32)])


def _means(stats: dict) -> dict:
    return {k: v[0] / v[1].clamp(min=1.0) for k, v in stats.items()}


def policy_loss_parts(
    logprob, old_logprob, advantages, mask, clip_low: float, clip_high: float,
    dual_clip: float | None = None, agg: str = "token-mean", seq_lengths=None,
):
    """Clipped PPO surrogate as ``(numerator, count, metrics)``; metrics are ``[sum, count]`` pairs.

    ratio = exp(clamp(logp - old, -20, 20)); pg = max(-A ratio, -A clamp(ratio, 1 - clip_low,
    1 + clip_high)); with ``dual_clip`` c > 1, tokens with A < 0 use min(pg, -A c).
    Metrics (token means): clipfrac, dual_clipfrac, approx_kl (k2: 0.5 (logp - old)^2), ratio_mean.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    old_logprob, advantages = old_logprob.detach(), advantages.detach()
    log_ratio = (_as_float(logprob) - old_logprob).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    dual_active = torch.zeros_like(pg, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (pg > bound)
        pg = torch.where(dual_active, bound.to(pg.dtype), pg)
    numerator, count = aggregate_parts(pg, mask, agg, seq_lengths)
    diff = logprob.detach().float() - old_logprob.float()
    metrics = {
        "clipfrac": _token_stat((pg2 > pg1).float(), mask),
        "dual_clipfrac": _token_stat(dual_active.float(), mask),
        "approx_kl": _token_stat(0.5 * diff * diff, mask),
        "ratio_mean": _token_stat(ratio, mask),
    }
    return numerator, count, metrics


def policy_loss(
    logprob, old_logprob, advantages, mask, clip_low: float, clip_high: float,
    dual_clip: float | None = None, agg: str = "token-mean", seq_lengths=None, denominator=None,
):
    """Clipped PPO surrogate as a scalar, plus token-mean metrics (see ``policy_loss_parts``)."""
    numerator, count, stats = policy_loss_parts(
        logprob, old_logprob, advantages, mask, clip_low, clip_high, dual_clip, agg, seq_lengths
    )
    return _divide(numerator, count, denominator), _means(stats)


def value_loss_parts(values, old_values, returns, mask, clip: float | None, agg: str = "token-mean", seq_lengths=None):
    """Clipped value loss as ``(numerator, count, metrics)``; metrics are ``[sum, count]`` pairs.

    loss = 0.5 max((v - R)^2, (old + clamp(v - old, -clip, clip) - R)^2), or 0.5 (v - R)^2 when
    ``clip`` is None.  Metrics (token means): vf_clipfrac (clipped term strictly larger), vpred_mean.
    """
    v = _as_float(values)
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (v - returns) ** 2
    if clip is None:
        loss_mat = 0.5 * unclipped
        clipped_used = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clipped = old_values + (v - old_values).clamp(-clip, clip)
        clipped = (v_clipped - returns) ** 2
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        clipped_used = clipped > unclipped
    numerator, count = aggregate_parts(loss_mat, mask, agg, seq_lengths)
    metrics = {"vf_clipfrac": _token_stat(clipped_used.float(), mask), "vpred_mean": _token_stat(v, mask)}
    return numerator, count, metrics


def value_loss(
    values, old_values, returns, mask, clip: float | None, agg: str = "token-mean", seq_lengths=None, denominator=None
):
    """Clipped value loss as a scalar, plus token-mean metrics (see ``value_loss_parts``)."""
    numerator, count, stats = value_loss_parts(values, old_values, returns, mask, clip, agg, seq_lengths)
    return _divide(numerator, count, denominator), _means(stats)


def entropy_bonus_parts(entropy, mask, agg: str, seq_lengths=None):
    """``(numerator, count)`` of the entropy, to combine as (pg - coef * entropy) / one denominator."""
    return aggregate_parts(entropy, mask, agg, seq_lengths)


@torch.no_grad()
def explained_variance(values, returns, mask):
    """1 - Var(R - V) / Var(R) over valid tokens; NaN when Var(R) is 0 or nothing is valid."""
    n = _valid(mask).sum().to(torch.float32)
    r, v = returns.float(), values.float()

    def var(x):
        mean = _masked(x, mask).sum() / n.clamp(min=1.0)
        return (_masked(x - mean, mask) ** 2).sum() / n.clamp(min=1.0)

    var_r = var(r)
    ev = 1.0 - var(r - v) / var_r
    return torch.where(var_r > 0, ev, torch.full_like(ev, float("nan")))


def _divide(numerator, count, denominator):
    if denominator is None:
        denominator = torch.where(count > 0, count, torch.ones_like(count))
    return numerator / denominator
