"""Batches generated ahead of the step that trains them (``trainer.mode`` one_step_off or async,
or generator ranks of their own), and how every checkpoint keeps them (plain lists in
``trainer_state.pt``), so a resumed run trains on exactly what the uninterrupted one would have."""

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


def buffer_state(buffer: dict[int, GeneratedBatch]) -> list[dict]:
    """``buffer`` as a checkpoint's ``rollout_buffer`` (what :func:`buffered_batches` reads back)."""
    return [{"step": j, **batch.state_dict()} for j, batch in sorted(buffer.items())]
