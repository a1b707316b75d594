"""Where the PPO ratio's old log-probs come from (``algorithm.old_logprobs``).

* ``recompute``: a no-grad forward of the actor over the whole batch before the update (the
  trainer's own numbers, before any optimizer step of this step);
* ``training_forward``: the update's own forward, detached.  Exact only when the update is exactly
  on-policy -- one epoch, one mini-batch: the single training forward runs on the weights the
  recompute pass would have used, on the same micro-batches, so the old log-probs, the loss and
  the gradients are those of ``recompute``, one forward pass fewer.  Everything that reads the
  old log-probs only after the update (KL and entropy metrics, rollout-vs-trainer mismatch) reads
  that forward's outputs;
* ``rollout``: the log-probs the rollout engine sampled with (no recompute).  ``actor/entropy``
  and ``rollout/logprob_mismatch_*`` are then measured on the first mini-batch's training forward
  of the step (the weights before any update of the step; every sample when mini_batches=1);
* ``auto`` (default): ``training_forward`` when nothing stands in its way, else ``recompute``.

What needs the old log-probs *before* the update keeps the recompute pass under ``auto`` and is
refused with ``training_forward``: more than one optimizer step per rollout (``ppo_epochs`` > 1 or
``mini_batches`` > 1), rollout correction (its weights multiply the loss), a KL penalty in the
reward (it changes the advantages) and on-policy distillation (its advantages are teacher minus
student log-probs).  Config validation enforces it (``megatron_rl/features/algorithms.py``).
"""

from __future__ import annotations

import dataclasses

from megatron_rl.config.choices import AUTO, OLD_LOGPROB_SOURCES, require_same


def training_forward_blockers(alg) -> list[str]:
    """Why ``training_forward`` would not give the recompute pass's numbers for ``alg`` (empty: it does)."""
    out = []
    if alg.ppo_epochs != 1:
        out.append(f"algorithm.ppo_epochs={alg.ppo_epochs} (needs 1)")
    if alg.mini_batches != 1:
        out.append(f"algorithm.mini_batches={alg.mini_batches} (needs 1)")
    if alg.rollout_correction.mode != "off":
        out.append(f"algorithm.rollout_correction.mode={alg.rollout_correction.mode} (needs off)")
    if alg.kl_in_reward and alg.kl_coef > 0:
        out.append("algorithm.kl_in_reward=true (needs false, or kl_coef=0)")
    if alg.distill.teachers:
        out.append("algorithm.distill (its advantages read the student's log-probs)")
    return out


def resolve_old_logprob_source(alg) -> str:
    """``alg.old_logprobs`` with ``auto`` resolved: training_forward when exactly on-policy, else recompute."""
    if alg.old_logprobs != "auto":
        return alg.old_logprobs
    return "recompute" if training_forward_blockers(alg) else "training_forward"


@dataclasses.dataclass(frozen=True)
class OldLogprobSource:
    """How one ``algorithm.old_logprobs`` source obtains the policy before the update.

    ``recompute``: a no-grad pass of the actor before the update measures it;
    ``from_rollout``: the loss reads the engine's sampling log-probs;
    neither: the loss reads its own forward's, detached.  Without ``recompute`` the trainer's
    log-probs, entropy and (with ``training_forward``) the KL are measured on the update's first
    forward, on the weights before any update of the step."""

    name: str
    recompute: bool
    from_rollout: bool

    @property
    def measured_in_update(self) -> bool:
        return not self.recompute

    @property
    def loss_reads_old(self) -> bool:
        """Whether the loss gets the old log-probs as an input (else it takes its own forward's)."""
        return self.recompute or self.from_rollout


SOURCES: dict[str, OldLogprobSource] = {
    "recompute": OldLogprobSource("recompute", recompute=True, from_rollout=False),
    "training_forward": OldLogprobSource("training_forward", recompute=False, from_rollout=False),
    "rollout": OldLogprobSource("rollout", recompute=False, from_rollout=True),
}


def old_logprob_source(name: str) -> OldLogprobSource:
    """The strategy for a resolved ``algorithm.old_logprobs`` (``auto`` is resolved before launch)."""
    try:
        return SOURCES[name]
    except KeyError:
        raise ValueError(f"algorithm.old_logprobs={name!r} is not resolved; resolve the config first") from None


require_same((AUTO, *SOURCES), OLD_LOGPROB_SOURCES, "algorithm.old_logprobs")
