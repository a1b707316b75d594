"""Preemption: SIGTERM / SIGUSR1 ask for a checkpoint at the next step boundary, then exit 0.

The handler only records the request (it may arrive twice: from the scheduler and again from
torchrun).  At each step boundary all ranks agree with one all-reduce whether any of them was
asked to stop, so every rank stops after the same step and the checkpoint is consistent.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test worker thread)
                pass

    def _handle(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum = signum

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to stop (a collective: call on all ranks)."""
        flag = torch.tensor([1 if self.signum is not None else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
