"""The actor's policy before this step's update, measured where ``algorithm.old_logprobs`` says.

The experience (:class:`megatron_rl.trainer.experience.Experience`) holds what is known before the
update and is never edited after it.  What only the update's first forward can measure (with
``training_forward`` the old log-probs themselves; with ``rollout`` the trainer's own log-probs
for the mismatch metrics) comes back from the update as a :class:`PolicyPass`, and
:func:`old_policy` puts the two together the same way for every source.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_rl.algorithms.kl import token_kl


@dataclasses.dataclass(frozen=True)
class PolicyPass:
    """The trainer's log-probs and entropy (``[B, R]``, zero outside ``rows``) from one forward of
    the actor on the weights before the update; ``rows`` marks the samples it saw (None: all)."""

    logprob: torch.Tensor
    entropy: torch.Tensor
    rows: Optional[torch.Tensor] = None

    @classmethod
    def from_outputs(cls, samples, mask: torch.Tensor, outs: list[dict], members: Optional[list[int]] = None):
        """From per-sequence outputs (``logprob``, ``entropy`` over the full sequence) of the samples
        ``members`` (None: every sample, in order)."""
        if members is None:
            return cls(samples.pad_responses([o["logprob"] for o in outs]) * mask,
                       samples.pad_responses([o["entropy"] for o in outs]) * mask)
        logprob = [torch.zeros(len(p) + len(r)) for p, r in zip(samples.prompt_ids, samples.response_ids)]
        entropy = list(logprob)
        rows = torch.zeros(len(samples), dtype=torch.bool)
        for i, out in zip(members, outs):
            logprob[i], entropy[i], rows[i] = out["logprob"], out["entropy"], True
        mask = mask * rows[:, None]
        return cls(samples.pad_responses(logprob) * mask, samples.pad_responses(entropy) * mask, rows)


@dataclasses.dataclass(frozen=True)
class OldPolicy:
    """What the step's metrics and KL controller read of the policy before the update."""

    logprob: torch.Tensor                   # the PPO ratio's old log-probs (on ``measured`` rows)
    trainer_logprob: Optional[torch.Tensor]  # the trainer's own, where measured (None: not measured)
    entropy: Optional[torch.Tensor]
    measured: Optional[torch.Tensor]        # rows the trainer's numbers cover (None: every row)
    kl: Optional[torch.Tensor]              # per-token KL of ``logprob`` to the reference


def old_policy(exp, trainer_pass: Optional[PolicyPass], kl_kind: str) -> OldPolicy:
    """The old policy of ``exp``: its old log-probs where the loss read them as an input, else the
    update's own forward (``training_forward``: exactly those of a recompute pass)."""
    logprob = exp.old_logprob if exp.old_logprob is not None else trainer_pass.logprob
    kl = token_kl(logprob, exp.ref_logprob, exp.mask, kl_kind) if exp.ref_logprob is not None else None
    if trainer_pass is None:
        return OldPolicy(logprob, None, None, None, kl)
    return OldPolicy(logprob, trainer_pass.logprob, trainer_pass.entropy, trainer_pass.rows, kl)
