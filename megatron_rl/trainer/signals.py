"""Preemption and Ctrl-C: SIGTERM, SIGUSR1 and a first SIGINT ask for a checkpoint at the next step
boundary, then exit 0; a second SIGINT aborts at once (exit 130, no checkpoint).

The handler only records the request (it may arrive twice: from the scheduler and again from
torchrun).  At each step boundary all ranks agree with one all-reduce whether any of them was
asked to stop, so every rank stops after the same step and the checkpoint is consistent.
"""

from __future__ import annotations

import signal
import sys

from megatron_rl.distributed import collectives, guard


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test worker thread)
                pass

    def _handle(self, signum, _frame) -> None:
        if signum == signal.SIGINT:
            if self.signum == signal.SIGINT:  # the second: stop now, without the checkpoint
                guard.abort_now("aborted (Ctrl-C twice); no checkpoint of the current step")
            print("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again aborts without one)",
                  file=sys.stderr, flush=True)
        if self.signum is None:
            self.signum = signum

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to stop (a collective: call on all ranks)."""
        return collectives.agree_any(self.signum is not None)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
