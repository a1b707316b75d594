"""KL to the reference policy: per-token estimators (a registry), the coefficient controllers, the reward penalty.

The estimators follow Schulman's note "Approximating KL Divergence".  With ``d = logp - ref`` (the
log-ratio policy / reference on the sampled token) and ``r = -d``:

* ``k1`` / ``kl``: ``d``; gradient ``1``.
* ``k2`` / ``mse``: ``d^2 / 2``; gradient ``d``.
* ``k3`` / ``low_var_kl``: ``clamp(e^r - r - 1, 0, 10)`` with ``r`` clamped to [-20, 20] first;
  gradient ``1 - e^r = 1 - pi_ref / pi`` inside the bounds, 0 where a clamp is active (k3 at 10,
  or ``|r| >= 20``).
* ``abs``: ``|d|``; gradient ``sign(d)``.
* ``k3+`` / ``low_var_kl+``: k3's value, k2's gradient ``d`` (straight-through).

k1 is unbiased but can be negative; k2 and k3 are non-negative with lower variance.  k3 is bounded
above by 10 as in verl: a token on which the policies disagree completely (``pi_ref / pi`` above
about 13.6, i.e. ``r > 2.61``, or below ``e^-11``) adds 10 and no gradient, instead of up to
``e^20 ~ 4.85e8``, so one such token cannot dominate a loss.  ``k3+`` keeps k3's (bounded) value for
metrics and the loss but takes k2's gradient, which still pulls such tokens back.

Adding an estimator is one decorated function here (``@register_kl("name", "alias")``);
``algorithm.kl_kind`` accepts every registered name and alias.

Controllers carry state across steps, so they checkpoint it: a resumed run must continue with the
same coefficient.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from megatron_rl.config.choices import KL_CONTROLLERS

# exp(r) overflows float32 near r = 88; beyond |r| = 20 the policies disagree completely anyway.
_K3_LOG_RATIO_LIMIT = 20.0
# verl's bound on the k3 estimate: e^20 ~ 4.85e8 as a loss term would swamp every other token.
K3_BOUND = 10.0


@dataclasses.dataclass(frozen=True)
class KLEstimator:
    name: str
    fn: Callable  # fn(logprob, ref_logprob) -> per-token estimate (differentiable in logprob)
    aliases: tuple
    summary: str


KL_ESTIMATORS: dict[str, KLEstimator] = {}  # canonical name -> estimator
KL_NAMES: dict[str, KLEstimator] = {}  # every accepted name (canonical and aliases): algorithm.kl_kind


def register_kl(name: str, *aliases: str):
    """Register ``fn(logprob, ref_logprob) -> [same shape]`` as ``name`` (and ``aliases``)."""

    def decorate(fn: Callable) -> Callable:
        for n in (name, *aliases):
            if n in KL_NAMES:
                raise ValueError(f"KL estimator name {n!r} is already registered")
        summary = (fn.__doc__ or name).strip().splitlines()[0]
        est = KLEstimator(name, fn, tuple(aliases), summary)
        KL_ESTIMATORS[name] = est
        for n in (name, *aliases):
            KL_NAMES[n] = est
        return fn

    return decorate


@register_kl("k1", "kl")
def _k1(logprob, ref_logprob):
    """logp - ref (unbiased, can be negative)."""
    return logprob - ref_logprob


@register_kl("k2", "mse")
def _k2(logprob, ref_logprob):
    """(logp - ref)^2 / 2."""
    diff = logprob - ref_logprob
    return 0.5 * diff * diff


@register_kl("k3", "low_var_kl")
def _k3(logprob, ref_logprob):
    """e^r - r - 1 with r = ref - logp clamped to [-20, 20], the estimate bounded to [0, 10]."""
    r = (ref_logprob - logprob).clamp(-_K3_LOG_RATIO_LIMIT, _K3_LOG_RATIO_LIMIT)
    return (torch.expm1(r) - r).clamp(0.0, K3_BOUND)


@register_kl("abs")
def _abs(logprob, ref_logprob):
    """|logp - ref|."""
    return (logprob - ref_logprob).abs()


@register_kl("k3+", "low_var_kl+")
def _k3_plus(logprob, ref_logprob):
    """k3's value with k2's gradient (straight-through)."""
    k2 = _k2(logprob, ref_logprob)
    return k2 + (_k3(logprob, ref_logprob) - k2).detach()


def _canonical(kind: str) -> str:
    if kind not in KL_NAMES:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_NAMES)}")
    return KL_NAMES[kind].name


def estimate(logprob, ref_logprob, kind: str):
    """Per-token KL(policy || reference) estimate with the registered estimator ``kind`` (or an alias)."""
    _canonical(kind)
    return KL_NAMES[kind].fn(logprob, ref_logprob)


class FixedKLController:
    """A constant KL coefficient."""

    kind = "fixed"

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl, n_steps: int) -> None:
        """No-op; present so callers need not know which controller they hold."""

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"KL controller state is for {state.get('kind')!r}, this controller is {self.kind!r}")
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Adaptive coefficient of Ziegler et al. (2019) steering the measured KL towards ``target``.

    error = clip(kl / target - 1, -0.2, 0.2); coef *= 1 + error * n_steps / horizon.
    """

    kind = "adaptive"

    def __init__(self, init_coef: float, target: float, horizon: float):
        super().__init__(init_coef)
        if target is None or target <= 0:
            raise ValueError(f"adaptive KL target must be > 0, got {target}")
        if horizon is None or horizon <= 0:
            raise ValueError(f"adaptive KL horizon must be > 0, got {horizon}")
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps: int) -> None:
        """Move the coefficient after ``n_steps`` samples (or steps) whose mean KL was ``current_kl``."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {**super().state_dict(), "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        """Restore the coefficient; ``target`` and ``horizon`` stay as configured."""
        super().load_state_dict(state)


def make_kl_controller(kind: str, coef: float, target: float | None = None, horizon: float | None = None):
    """Build a ``fixed`` or ``adaptive`` controller; adaptive needs ``target`` and ``horizon``."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; valid: {', '.join(KL_CONTROLLERS)}")


@torch.no_grad()
def token_kl(logprob, ref_logprob, mask, kind: str = "k1"):
    """The per-token KL estimate ``kind``, 0 at masked positions."""
    m = mask.to(torch.float32)
    return torch.where(m > 0, estimate(logprob.float(), ref_logprob.float(), kind), torch.zeros_like(m))


def apply_kl_penalty(token_rewards, logprob, ref_logprob, mask, coef, kind: str = "k1"):
    """Subtract ``coef * KL`` from per-token rewards; returns ``(rewards_with_penalty, kl)``.

    ``kl`` (:func:`token_kl`) is 0 at masked positions, so rewards there pass through unchanged.
    """
    kl = token_kl(logprob, ref_logprob, mask, kind)
    return token_rewards - coef * kl, kl
