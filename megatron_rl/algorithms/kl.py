"""KL to the reference policy: per-token estimators, the coefficient controllers, the reward penalty.

The estimators follow Schulman's note "Approximating KL Divergence": k1 is unbiased but can be
negative, k2 and k3 are non-negative with lower variance.  Controllers carry state across
steps, so they checkpoint it: a resumed run must continue with the same coefficient.
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3")
_ALIASES = {"low_var_kl": "k3", "mse": "k2"}
KL_NAMES = KL_KINDS + tuple(_ALIASES)  # what algorithm.kl_kind accepts
KL_CONTROLLERS = ("fixed", "adaptive")

# exp(r) overflows float32 near r = 88; beyond |r| = 20 the policies disagree completely anyway.
_K3_LOG_RATIO_LIMIT = 20.0


def _canonical(kind: str) -> str:
    kind = _ALIASES.get(kind, kind)
    if kind not in KL_KINDS:
        valid = ", ".join(KL_KINDS + tuple(_ALIASES))
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {valid}")
    return kind


def estimate(logprob, ref_logprob, kind: str):
    """Per-token KL(policy || reference) estimate; ``kind`` is k1, k2, k3 or an alias.

    k1 = logp - ref; k2 = 0.5 (logp - ref)^2; k3 = exp(r) - r - 1 with r = ref - logp,
    r clamped to [-20, 20] against overflow.  ``low_var_kl`` means k3, ``mse`` means k2.
    """
    kind = _canonical(kind)
    diff = logprob - ref_logprob
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff * diff
    r = (-diff).clamp(-_K3_LOG_RATIO_LIMIT, _K3_LOG_RATIO_LIMIT)
    return (torch.expm1(r) - r).clamp(min=0.0)


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
    raise ValueError(f"unknown KL controller {kind!r}; valid: fixed, adaptive")


@torch.no_grad()
def apply_kl_penalty(token_rewards, logprob, ref_logprob, mask, coef, kind: str = "k1"):
    """Subtract ``coef * KL`` from per-token rewards; returns ``(rewards_with_penalty, kl)``.

    ``kl`` is 0 at masked positions, so rewards there pass through unchanged.  With ``coef=0`` the
    rewards come back unchanged (where the KL is finite): ``kl`` is only measured, for metrics and
    the controller.
    """
    m = mask.to(torch.float32)
    kl = torch.where(m > 0, estimate(logprob.float(), ref_logprob.float(), kind), torch.zeros_like(m))
    return token_rewards - coef * kl, kl
