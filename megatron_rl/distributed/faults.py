"""Fault injection for testing failure handling: ``MEGATRON_RL_FAULT=<kind>@rank=<r>:step=<s>``.

Kinds: ``raise`` (a Python exception), ``hang`` (sleep forever; peers hit the collective
timeout), ``kill`` (SIGKILL itself, as an OOM killer would), ``sigterm`` (ask itself to stop, as
a scheduler preempting the job would).  Read once per process; a no-op when unset.  The
trainer and the smoke job call :func:`maybe_inject` at the start of every step.
"""

from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist

ENV = "MEGATRON_RL_FAULT"


def _parse(spec: str) -> tuple[str, int, int]:
    kind, _, where = spec.partition("@")
    fields = dict(part.split("=", 1) for part in where.split(":") if "=" in part)
    return kind, int(fields.get("rank", 0)), int(fields.get("step", 1))


def maybe_inject(step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    kind, rank, at_step = _parse(spec)
    my_rank = dist.get_rank() if dist.is_initialized() else 0
    if my_rank != rank or step != at_step:
        return
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
    raise ValueError(f"{ENV}: unknown fault kind {kind!r} (raise, hang, kill, sigterm)")
