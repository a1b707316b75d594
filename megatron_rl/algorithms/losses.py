"""Policy/value losses split into ``(numerator, count)`` so one denominator can span the batch.

The engine cuts a mini-batch into micro-batches, data-parallel ranks and context-parallel
shards (each CP rank holds part of every sequence), then divides once by the global count.
That only equals the whole-batch loss if every piece returns a sum and a count that add up.
For the per-sequence modes a CP shard counts each row by the fraction of the row's tokens it
holds (``local_len / seq_len``), so the shards of a row sum to exactly one row.  A loss that
needs a whole-sequence quantity (GSPO's sequence ratio) gets it through ``row_sum``, which the
trainer reduces over the CP group; it is only ever applied to detached values.

Two registries, one decorated function per entry:

* :data:`AGG_MODES` -- loss aggregations (``algorithm.loss_agg``), each with the unit its global
  denominator counts (tokens or sequences);
* :data:`POLICY_LOSSES` -- policy losses (``algorithm.policy_loss``): ``fn(inputs, opts)`` returns
  the per-token loss ``[B, T]`` and per-token metric values; :func:`policy_loss_terms` applies the
  rollout-correction weights and the aggregation.  ``opts`` is the ``AlgorithmConfig``.

Metrics are masked token means over valid tokens whatever ``agg`` is.  The ``*_parts`` /
``*_terms`` functions return them as ``name -> tensor([sum, count])`` (detached) so they too can
be summed across pieces before dividing; the plain functions return the divided scalars.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Callable, Optional

import torch

_LOG_RATIO_LIMIT = 20.0
TOKENS, SEQUENCES = "tokens", "sequences"


def _valid(mask):
    return mask > 0


def _masked(x, mask):
    """``x`` where mask is set, else 0; unlike ``x * mask`` this keeps NaN/inf in padding out."""
    return torch.where(_valid(mask), x, torch.zeros_like(x))


def _as_float(x):
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# ---------------------------------------------------------------------------- aggregations


@dataclasses.dataclass(frozen=True)
class Aggregation:
    name: str
    fn: Callable  # fn(rows: Rows, horizon) -> (numerator, count)
    unit: str  # what the mini-batch's global denominator counts: TOKENS or SEQUENCES
    summary: str


AGG_MODES: dict[str, Aggregation] = {}


def register_aggregation(name: str, unit: str):
    """Register ``fn(rows: Rows, horizon) -> (numerator, count)`` as loss aggregation ``name``."""
    if unit not in (TOKENS, SEQUENCES):
        raise ValueError(f"unit must be {TOKENS!r} or {SEQUENCES!r}, got {unit!r}")

    def decorate(fn: Callable) -> Callable:
        if name in AGG_MODES:
            raise ValueError(f"loss aggregation {name!r} is already registered")
        AGG_MODES[name] = Aggregation(name, fn, unit, (fn.__doc__ or name).strip().splitlines()[0])
        return fn

    return decorate


@dataclasses.dataclass
class Rows:
    """A masked ``[B, T]`` loss with each row's local and full valid lengths."""

    loss: torch.Tensor  # 0 where masked
    local_len: torch.Tensor  # [B] valid tokens in this piece
    full_len: torch.Tensor  # [B] valid tokens of the whole row (CP: all shards)

    @property
    def has_len(self):
        return self.full_len > 0

    @property
    def safe_len(self):
        return torch.where(self.has_len, self.full_len, torch.ones_like(self.full_len))

    def row_count(self):
        """Rows this piece holds: ``local_len / full_len`` each (1 for a whole row, 0 if empty)."""
        return torch.where(self.has_len, self.local_len / self.safe_len, torch.zeros_like(self.full_len)).sum()


@register_aggregation("token-mean", TOKENS)
def _token_mean(rows: Rows, horizon):
    """Sum of valid token losses / valid tokens of the mini-batch."""
    return rows.loss.sum(), rows.local_len.sum()


@register_aggregation("seq-mean-token-sum", SEQUENCES)
def _seq_mean_token_sum(rows: Rows, horizon):
    """Mean over sequences of each sequence's token sum."""
    return rows.loss.sum(-1).sum(), rows.row_count()


@register_aggregation("seq-mean-token-mean", SEQUENCES)
def _seq_mean_token_mean(rows: Rows, horizon):
    """Mean over sequences of each sequence's token mean."""
    row_sum = rows.loss.sum(-1)
    row_mean = torch.where(rows.has_len, row_sum / rows.safe_len.to(row_sum.dtype), torch.zeros_like(row_sum))
    return row_mean.sum(), rows.row_count()


@register_aggregation("seq-mean-token-sum-norm", SEQUENCES)
def _seq_mean_token_sum_norm(rows: Rows, horizon):
    """Mean over sequences of each sequence's token sum / a constant L (rollout.max_new_tokens): Dr.GRPO."""
    if horizon is None or horizon <= 0:
        raise ValueError("seq-mean-token-sum-norm needs horizon > 0 (the trainer passes rollout.max_new_tokens)")
    return rows.loss.sum(-1).sum() / float(horizon), rows.row_count()


def get_aggregation(agg: str) -> Aggregation:
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGG_MODES)}")
    return AGG_MODES[agg]


def aggregate_parts(loss_mat, mask, agg: str, seq_lengths=None, horizon: Optional[float] = None):
    """``(numerator, count)`` of ``loss_mat`` ``[B, T]`` under ``agg``; numerator keeps the graph.

    token-mean: (sum of valid losses, valid tokens).  seq-mean-token-sum: (sum of row sums,
    rows).  seq-mean-token-mean: (sum of row sum / seq_len, rows).  seq-mean-token-sum-norm:
    (sum of row sums / ``horizon``, rows).  ``seq_lengths`` ``[B]`` is each row's full valid
    length (default: ``mask.sum(-1)``); a row counts as ``local_len / seq_len`` rows, i.e. 1 for a
    whole row with a valid token, a fraction for a CP shard, 0 for an empty row.  ``count`` is a
    float32 tensor.
    """
    mode = get_aggregation(agg)
    loss = _masked(_as_float(loss_mat), mask)
    local_len = _valid(mask).sum(-1).to(torch.float32)
    full_len = local_len if seq_lengths is None else seq_lengths.to(local_len.device, torch.float32)
    if full_len.shape != local_len.shape:
        raise ValueError(f"seq_lengths must be [B]={tuple(local_len.shape)}, got {tuple(full_len.shape)}")
    return mode.fn(Rows(loss, local_len, full_len), horizon)


def aggregate(loss_mat, mask, agg: str, seq_lengths=None, denominator=None, horizon=None):
    """Scalar loss: numerator / ``denominator`` if given, else / count (a zero count becomes 1)."""
    numerator, count = aggregate_parts(loss_mat, mask, agg, seq_lengths, horizon)
    return _divide(numerator, count, denominator)


def global_denominator(agg: str, valid_lengths) -> float:
    """The mini-batch's denominator for ``agg``: valid tokens, or sequences with a valid token (>= 1)."""
    if get_aggregation(agg).unit == TOKENS:
        return float(max(1, sum(valid_lengths)))
    return float(max(1, sum(1 for n in valid_lengths if n > 0)))


def _token_stat(x, mask):
    """Detached ``tensor([sum over valid tokens, valid tokens])`` for cross-piece reduction."""
    x = _masked(x.detach().float(), mask)
    return torch.stack([x.sum(), _valid(mask).sum().to(torch.float32)])


def _means(stats: dict) -> dict:
    return {k: v[0] / v[1].clamp(min=1.0) for k, v in stats.items()}


# ---------------------------------------------------------------------------- policy losses


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    name: str
    fn: Callable  # fn(inputs: PolicyInputs, opts) -> (loss [B, T], {metric: per-token values [B, T]})
    metrics: tuple  # the metric names fn returns (the trainer reduces them over ranks by name)
    uses_dual_clip: bool
    summary: str


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, metrics: tuple = ("clipfrac", "approx_kl", "ratio_mean"),
                         uses_dual_clip: bool = False):
    """Register ``fn(inputs: PolicyInputs, opts) -> (loss_mat, metric_mats)`` as policy loss ``name``."""

    def decorate(fn: Callable) -> Callable:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        summary = (fn.__doc__ or name).strip().splitlines()[0]
        POLICY_LOSSES[name] = PolicyLoss(name, fn, tuple(metrics), uses_dual_clip, summary)
        return fn

    return decorate


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def local_row_sum(x):
    """Sum of each row of ``x`` ``[B, T]`` (the whole row is here: no context parallelism)."""
    return x.sum(-1)


@dataclasses.dataclass
class PolicyInputs:
    logprob: torch.Tensor  # [B, T] current policy, differentiable
    old_logprob: torch.Tensor  # [B, T] detached
    advantages: torch.Tensor  # [B, T] detached
    mask: torch.Tensor  # [B, T]
    seq_lengths: torch.Tensor  # [B] full valid length of each row
    row_sum: Callable = local_row_sum  # [B, T] detached -> [B] sum over the whole row (all CP shards)

    def log_ratio(self):
        """``clamp(logp - old, -20, 20)`` (exp would overflow float32 beyond ~88)."""
        return (self.logprob - self.old_logprob).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)

    def approx_kl(self):
        """k2 of the current vs the old policy, per token (a metric)."""
        diff = self.logprob.detach().float() - self.old_logprob.float()
        return 0.5 * diff * diff


def _check_clips(opts):
    if opts.clip_low < 0 or opts.clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {opts.clip_low}, {opts.clip_high}")


@register_policy_loss("ppo", metrics=("clipfrac", "dual_clipfrac", "approx_kl", "ratio_mean"), uses_dual_clip=True)
def _ppo(inp: PolicyInputs, opts):
    """PPO clipped surrogate: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = pi / pi_old per token."""
    _check_clips(opts)
    dual_clip = getattr(opts, "dual_clip", None)
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    adv = inp.advantages
    ratio = torch.exp(inp.log_ratio())
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - opts.clip_low, 1.0 + opts.clip_high)
    pg = torch.maximum(pg1, pg2)
    dual_active = torch.zeros_like(pg, dtype=torch.bool)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_active = (adv < 0) & (pg > bound)
        pg = torch.where(dual_active, bound.to(pg.dtype), pg)
    metrics = {"clipfrac": (pg2 > pg1).float(), "dual_clipfrac": dual_active.float(),
               "approx_kl": inp.approx_kl(), "ratio_mean": ratio}
    return pg, metrics


@register_policy_loss("gspo")
def _gspo(inp: PolicyInputs, opts):
    """GSPO: the PPO clip on the sequence ratio s = exp(mean over the sequence of log(pi / pi_old))."""
    _check_clips(opts)
    diff = _masked(inp.logprob.detach() - inp.old_logprob, inp.mask)
    lengths = inp.seq_lengths.to(diff.dtype).clamp(min=1.0)
    seq_log_ratio = (inp.row_sum(diff) / lengths).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    # s_{i,t} = sg(s_i) * pi_t / sg(pi_t): value s_i on every token, gradient s_i * grad log pi_t, so
    # averaging over the sequence's tokens gives s_i * grad log s_i.
    ratio = torch.exp(seq_log_ratio[:, None] + inp.logprob - inp.logprob.detach())
    adv = inp.advantages
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - opts.clip_low, 1.0 + opts.clip_high)
    pg = torch.maximum(pg1, pg2)
    metrics = {"clipfrac": (pg2 > pg1).float(), "approx_kl": inp.approx_kl(), "ratio_mean": ratio.detach()}
    return pg, metrics


@register_policy_loss("cispo")
def _cispo(inp: PolicyInputs, opts):
    """CISPO: -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi; every token keeps a gradient."""
    _check_clips(opts)
    ratio = torch.exp(inp.log_ratio()).detach()
    weight = ratio.clamp(max(0.0, 1.0 - opts.clip_low), 1.0 + opts.clip_high)
    loss = -inp.advantages * weight * inp.logprob
    metrics = {"clipfrac": (weight != ratio).float(), "approx_kl": inp.approx_kl(), "ratio_mean": ratio}
    return loss, metrics


def policy_loss_terms(
    name: str, logprob, old_logprob, advantages, mask, opts, *, agg: str = "token-mean", seq_lengths=None,
    horizon: Optional[float] = None, weights=None, row_sum: Optional[Callable] = None,
):
    """Registered policy loss ``name`` as ``(numerator, count, metrics)``; metrics are ``[sum, count]``.

    ``weights`` ``[B, T]`` (rollout correction, detached) multiply the per-token loss before the
    aggregation; ``row_sum`` reduces a detached ``[B, T]`` over whole rows (CP: over the group).
    """
    entry = get_policy_loss(name)
    logprob = _as_float(logprob)
    lengths = _valid(mask).sum(-1).to(torch.float32) if seq_lengths is None else seq_lengths
    inp = PolicyInputs(logprob, old_logprob.detach().to(logprob.dtype), advantages.detach().to(logprob.dtype), mask,
                       lengths.to(logprob.device), row_sum or local_row_sum)
    loss_mat, metric_mats = entry.fn(inp, opts)
    if weights is not None:
        loss_mat = loss_mat * weights.detach().to(loss_mat.dtype)
    numerator, count = aggregate_parts(loss_mat, mask, agg, seq_lengths, horizon)
    return numerator, count, {k: _token_stat(v, mask) for k, v in metric_mats.items()}


def policy_loss_parts(
    logprob, old_logprob, advantages, mask, clip_low: float, clip_high: float,
    dual_clip: float | None = None, agg: str = "token-mean", seq_lengths=None,
):
    """Clipped PPO surrogate as ``(numerator, count, metrics)``; metrics are ``[sum, count]`` pairs.

    ratio = exp(clamp(logp - old, -20, 20)); pg = max(-A ratio, -A clamp(ratio, 1 - clip_low,
    1 + clip_high)); with ``dual_clip`` c > 1, tokens with A < 0 use min(pg, -A c).
    Metrics (token means): clipfrac, dual_clipfrac, approx_kl (k2: 0.5 (logp - old)^2), ratio_mean.
    """
    opts = SimpleNamespace(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    return policy_loss_terms("ppo", logprob, old_logprob, advantages, mask, opts, agg=agg, seq_lengths=seq_lengths)


def policy_loss(
    logprob, old_logprob, advantages, mask, clip_low: float, clip_high: float,
    dual_clip: float | None = None, agg: str = "token-mean", seq_lengths=None, denominator=None,
):
    """Clipped PPO surrogate as a scalar, plus token-mean metrics (see ``policy_loss_parts``)."""
    numerator, count, stats = policy_loss_parts(
        logprob, old_logprob, advantages, mask, clip_low, clip_high, dual_clip, agg, seq_lengths
    )
    return _divide(numerator, count, denominator), _means(stats)


def value_loss_parts(values, old_values, returns, mask, clip: float | None, agg: str = "token-mean", seq_lengths=None,
                     horizon=None):
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
        delta = v - old_values
        # Inside the range the clipped value is ``v`` itself: ``old + (v - old)`` can round to an
        # ulp away from ``v`` and would count the token as clipped by noise.
        v_clipped = torch.where(delta.abs() > clip, old_values + delta.clamp(-clip, clip), v)
        clipped = (v_clipped - returns) ** 2
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        clipped_used = clipped > unclipped
    numerator, count = aggregate_parts(loss_mat, mask, agg, seq_lengths, horizon)
    metrics = {"vf_clipfrac": _token_stat(clipped_used.float(), mask), "vpred_mean": _token_stat(v, mask)}
    return numerator, count, metrics


def value_loss(
    values, old_values, returns, mask, clip: float | None, agg: str = "token-mean", seq_lengths=None, denominator=None
):
    """Clipped value loss as a scalar, plus token-mean metrics (see ``value_loss_parts``)."""
    numerator, count, stats = value_loss_parts(values, old_values, returns, mask, clip, agg, seq_lengths)
    return _divide(numerator, count, denominator), _means(stats)


def entropy_bonus_parts(entropy, mask, agg: str, seq_lengths=None, horizon=None):
    """``(numerator, count)`` of the entropy, to combine as (pg - coef * entropy) / one denominator."""
    return aggregate_parts(entropy, mask, agg, seq_lengths, horizon)


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
