"""Fault injection for testing failure handling: ``MEGATRON_RL_FAULT=<kind>@rank=<r>:step=<s>``
(``role=generator`` in the fields: generator rank ``r`` of ``rollout.ranks``, when it starts the
batch of step ``s``; else training rank ``r``; ``phase=evaluation``: when the evaluation after
step ``s`` starts; ``phase=sft``: at SFT warm-up step ``s``).

Kinds injected at the start of step s (the trainer and the smoke job call :func:`maybe_inject`
there): ``raise`` (a Python exception), ``hang`` (sleep forever; peers hit the collective
timeout), ``kill`` (SIGKILL itself, as an OOM killer would), ``sigterm`` (ask itself to stop, as
a scheduler preempting the job would), ``ctrl_c_twice`` (SIGINT twice, as a user who does not
want to wait for the checkpoint).  Injected in the checkpoint save of step s, after its
space check (:func:`maybe_fill_disk`): ``fill_disk`` (another writer takes every free byte of the
checkpoint's disk, with a file ``disk_filler`` beside the checkpoints).  A no-op when unset.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Sequence

import torch.distributed as dist

ENV = "MEGATRON_RL_FAULT"
STEP_KINDS = ("raise", "hang", "kill", "sigterm", "ctrl_c_twice")
SAVE_KINDS = ("fill_disk",)


def _parse(spec: str) -> tuple[str, int, int, str, str]:
    kind, _, where = spec.partition("@")
    fields = dict(part.split("=", 1) for part in where.split(":") if "=" in part)
    return (kind, int(fields.get("rank", 0)), int(fields.get("step", 1)), fields.get("role", "trainer"),
            fields.get("phase", "step"))


def _due(step: int, kinds: tuple[str, ...], role: str = "trainer", phase: str = "step") -> tuple[str, str] | None:
    """``(kind, spec)`` when a fault of one of ``kinds`` is due on this rank at ``step`` in ``phase``."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    kind, rank, at_step, at_role, at_phase = _parse(spec)
    if kind not in STEP_KINDS + SAVE_KINDS:
        raise ValueError(f"{ENV}: unknown fault kind {kind!r} ({', '.join(STEP_KINDS + SAVE_KINDS)})")
    my_rank = dist.get_rank() if dist.is_initialized() else 0
    if kind not in kinds or my_rank != rank or step != at_step or role != at_role or phase != at_phase:
        return None
    return kind, spec


def _fill(path: str, mode: str = "wb") -> None:
    with open(path, mode, buffering=0) as fh:
        for size in (1 << 16, 1 << 10, 1):
            block = bytes(size)
            try:
                while True:
                    fh.write(block)
            except OSError:
                pass


def maybe_fill_disk(step: int, root: str, phase: str = "step", appended: Sequence[str] = ()) -> None:
    """The ``fill_disk`` fault: write zeros beside ``root`` until the disk refuses more.  Without a
    ``phase`` in the spec: in the checkpoint save of step ``step``; ``phase=metrics``,
    ``tensorboard``, ``samples``, ``plot``: just before that writer writes for step ``step``.
    ``appended``: files the writer appends to, whose last block still has room after the disk is
    full (a 4 KiB page of tmpfs): that room is taken too (with zeros: the file is spoilt)."""
    if _due(step, SAVE_KINDS, phase=phase) is None:
        return
    _fill(os.path.join(os.path.dirname(os.path.abspath(root)), "disk_filler"))
    for path in appended:
        _fill(path, "ab")


def maybe_inject(step: int, role: str = "trainer", phase: str = "step") -> None:
    due = _due(step, STEP_KINDS, role, phase)
    if due is None:
        return
    kind, spec = due
    rank = dist.get_rank() if dist.is_initialized() else 0
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({ENV}={spec})")
    if kind == "hang":
        while True:
            time.sleep(3600)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if kind == "ctrl_c_twice":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the first one's handler runs before the second arrives
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the second's handler ends the process
        return
