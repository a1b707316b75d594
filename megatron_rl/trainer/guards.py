"""Stop a run that no longer learns instead of logging ``null`` metrics.

A single optimizer step with non-finite gradients is skipped and counted
(``<phase>/skipped_updates``).  When every step of a phase in a PPO step is skipped, the weights
did not move and the same config will not recover: the run stops with one line that names the
likely cause.  It is reported as bad input (exit 2) because the fix is a config change.
"""

from __future__ import annotations

from typing import Sequence

from megatron_rl.config.schema import Config
from megatron_rl.engine.trainable import StepResult
from megatron_rl.errors import UserInputError


class NonFiniteUpdatesError(UserInputError):
    def one_line(self) -> str:
        return "training error: " + super().one_line()


def _fix(phase: str, cfg: Config) -> str:
    bf16 = "or train in float32 (model.params_dtype=float32) if bfloat16 overflows"
    if phase == "actor":
        return (f"lower actor.optim.lr, raise rollout.temperature (now {cfg.rollout.temperature}; "
                f"log-probs are computed from logits / temperature), {bf16}")
    return f"lower critic.optim.lr, {bf16}"


def check_updates_applied(phase: str, results: Sequence[StepResult], step: int, cfg: Config) -> None:
    """Raise :class:`NonFiniteUpdatesError` when no optimizer step of ``phase`` (``actor`` or
    ``critic``) in PPO step ``step`` was applied.  Every rank holds the same results, so every rank
    raises."""
    if not results or any(r.ok for r in results):
        return
    optim = cfg.actor.optim if phase == "actor" else cfg.critic.optim
    raise NonFiniteUpdatesError(
        f"{phase}.optim.lr", optim.lr,
        f"all {len(results)} {phase} optimizer steps of PPO step {step} were skipped ({results[0].reason})",
        _fix(phase, cfg),
    )
