"""What this process is doing now (``step 3, reward``), for the line that reports a rank that
ended early.

:func:`megatron_rl.utils.timing.timed` enters a phase for each timed block, and the trainer sets
the step.  Under the local launcher (``MEGATRON_RL_ERROR_FILE`` set) each change is also written
to ``<error file>.phase.rank<r>``, so the launcher can name the phase of a rank that vanished
without a word (a C library's ``exit(0)``); the write is a few bytes per timed block.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

ERROR_FILE_ENV = "MEGATRON_RL_ERROR_FILE"

_state: dict = {"step": None, "names": []}


def describe() -> str:
    """``step 3, reward``; ``starting`` before the first step and phase."""
    parts = [f"step {_state['step']}"] if _state["step"] is not None else []
    parts += [name for name in _state["names"] if name != "step"]  # the step's own timer: the number says it
    return ", ".join(parts) if parts else "starting"


def phase_file(base: str, rank: int) -> str:
    return f"{base}.phase.rank{rank}"


def _publish() -> None:
    base = os.environ.get(ERROR_FILE_ENV)
    if not base:
        return
    rank = int(os.environ.get("RANK", 0))
    try:
        with open(phase_file(base, rank), "w") as fh:
            fh.write(describe())
    except OSError:  # the launcher's directory is gone (the job is ending): nothing to tell
        pass


def at_step(step: Optional[int]) -> None:
    _state["step"] = step
    _publish()


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    _state["names"].append(name)
    _publish()
    try:
        yield
    finally:
        _state["names"].pop()
        _publish()
