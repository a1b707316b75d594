"""``trainer.mode=one_step_off``: each step trains on the batch generated one update earlier.

Step ``k`` starts from the weights of ``k - 1`` updates.  It generates the batch for step
``k + 1`` with them, then trains on the batch generated at step ``k - 1`` (with the weights of
``k - 2`` updates): every batch but the first is one policy version stale, as when generation of
the next batch overlaps the update on separate generators.  Here both run on the same ranks, one
after the other, so a step costs what a synchronous one does; what the mode gives is the
staleness and its correction (``algorithm.rollout_correction``, the recomputed old log-probs as
the proximal policy), tested and resumable.  The batches and their seeds are the synchronous
run's: batch ``k`` is drawn ``k``-th and sampled with the seed of step ``k``, so with frozen
weights the two modes train on the same samples.

The batch waiting for the next step is part of every checkpoint (``trainer_state.pt``, plain
lists), so a resumed run trains on exactly what the uninterrupted one would have; a run resumed in
``sync`` mode trains on it first, so no drawn prompt is skipped.  The last step of a run generates
nothing ahead; a run extended after it starts its next step from a fresh batch.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.trainer.experience import Samples


@dataclasses.dataclass
class GeneratedBatch:
    """Samples and the policy version that generated them (RL updates its weights had seen)."""

    samples: Samples
    version: int

    def state_dict(self) -> dict:
        return {"version": self.version, "samples": dataclasses.asdict(self.samples)}

    @classmethod
    def from_state_dict(cls, state: Optional[dict]) -> Optional["GeneratedBatch"]:
        if not state:
            return None
        return cls(Samples(**state["samples"]), int(state["version"]))


def buffered_batches(state: dict, step: int) -> dict[int, GeneratedBatch]:
    """The batches a checkpoint after ``step`` holds for the coming steps, by the step that trains
    them (checkpoints before ``rollout_buffer`` held at most the next step's, as ``pending``)."""
    if state.get("rollout_buffer"):
        return {int(b["step"]): GeneratedBatch.from_state_dict(b) for b in state["rollout_buffer"]}
    pending = GeneratedBatch.from_state_dict(state.get("pending"))
    return {step + 1: pending} if pending is not None else {}


def staleness_metrics(trained_version: int, batch_version: int) -> dict:
    """How many updates the weights a batch trains from are ahead of the ones that generated it."""
    return {"rollout/staleness_max": trained_version - batch_version, "rollout/policy_version": batch_version}
