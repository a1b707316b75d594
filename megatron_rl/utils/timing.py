"""Wall-clock timings of the phases of a step, under the metric keys ``timing/<name>_s``."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from megatron_rl.utils import phase


def timing_key(name: str) -> str:
    return f"timing/{name}_s"


@contextlib.contextmanager
def timed(name: str, timings: dict) -> Iterator[None]:
    """Add the seconds spent in the block to ``timings["timing/<name>_s"]`` (repeated blocks add up)."""
    start = time.perf_counter()
    try:
        with phase.entered(name):
            yield
    finally:
        key = timing_key(name)
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start
