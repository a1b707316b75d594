"""Preemption and Ctrl-C: SIGTERM, SIGUSR1 and a first SIGINT ask for a checkpoint at the next step
boundary, then exit 0; a second SIGINT aborts at once (exit 130, no checkpoint).

The handler only records the request (it may arrive twice: from the scheduler and again from
torchrun).  At each step boundary all ranks agree with one all-reduce whether any of them was
asked to stop, so every rank stops after the same step and the checkpoint is consistent.
"""

from __future__ import annotations

import signal
import sys
from typing import Callable, Optional

from megatron_rl.distributed import collectives, guard


class StopRequest:
    SIGNALS = guard.STOP_SIGNALS

    def __init__(self):
        self.signum: int | None = None
        # Set where ranks outside this world take signals too (generator ranks): who asked there, or None.
        self.asked_elsewhere: Callable[[], Optional[str]] = lambda: None
        self.elsewhere: Optional[str] = None
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
        if self.signum is None and self.elsewhere is None:
            self.elsewhere = self.asked_elsewhere()
        return collectives.agree_any(self.signum is not None or self.elsewhere is not None)

    def describe(self) -> str:
        """Which signal, for the line that says why the job stopped (on the rank that logs it)."""
        if self.signum is not None:
            return f"signal {self.signum}"
        return self.elsewhere or "signal on another rank"

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
