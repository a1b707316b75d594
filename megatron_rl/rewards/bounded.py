"""Per-sample time bound for graders: a child process that is killed when one sample overruns.

Signals (math-verify's approach) only work on the main thread, and a Python thread cannot be
stopped, so neither bounds a grader that loops.  Here each thread that grades owns one child
process (:mod:`megatron_rl.rewards.worker`); a batch is sent to it once, results stream back one
per sample, and each sample has ``timeout_s`` from the previous result.  A sample that overruns
scores 0 and is counted; the child is killed and a fresh one grades the rest.  The child imports
no torch, so a replacement starts in about a tenth of a second.

The grader crosses the process boundary by name (``module:qualname``, or ``path.py:qualname`` for a
reward file, which the child imports by its path), so it must be a module-level function of an
importable module or file; its keyword arguments and the samples (with their dataset columns) must
pickle.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Callable, Optional, Sequence

from megatron_rl.rewards.locations import file_of_module

DEFAULT_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 120.0  # starting a child and importing the grader is not charged to a sample

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GraderError(RuntimeError):
    """The grader raised on a sample, or its worker process could not run it.  ``detail``: the
    function's own ``"Type: message"`` when it raised (the message adds which sample)."""

    def __init__(self, message: str, detail: Optional[str] = None):
        super().__init__(message)
        self.detail = detail if detail is not None else message


class Scores(list):
    """A list of scores that also says how many samples ran out of time (and scored 0)."""

    def __init__(self, values=(), timed_out: int = 0):
        super().__init__(values)
        self.timed_out = timed_out


def grader_spec(fn: Callable) -> str:
    """``module:qualname`` of a module-level function, which the worker imports (``path.py:qualname``
    for a function of a reward file imported by its path)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(f"{fn!r} must be a module-level function of an importable module to run in a "
                         "grading worker (or pass timeout_s=None to grade in this process, unbounded)")
    return f"{file_of_module(module) or module}:{qualname}"


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()


class Worker:
    """One grading child process, started on first use and replaced after a timeout.  With a
    ``sandbox`` directory it runs there without network (tools, :mod:`megatron_rl.rewards.worker`)."""

    def __init__(self, sandbox: Optional[str] = None):
        self.sandbox = sandbox
        self.proc: Optional[subprocess.Popen] = None
        self.owner = os.getpid()
        _LIVE.add(self)

    def _start(self) -> None:
        parent_read, child_write = os.pipe()
        child_read, parent_write = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_rl.rewards.worker", str(child_read), str(child_write)],
            pass_fds=(child_read, child_write), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
        os.close(child_read)
        os.close(child_write)
        self.inbox = Connection(parent_read, writable=False)
        self.outbox = Connection(parent_write, readable=False)
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        self.outbox.send(("path", list(sys.path)))
        if self.sandbox is not None:
            self.outbox.send(("sandbox", self.sandbox))

    def stop(self) -> None:
        if self.proc is not None and os.getpid() == self.owner:
            _kill(self.proc)
            for conn in (self.inbox, self.outbox):
                conn.close()
        self.proc = None

    def _wait(self, timeout: float) -> bool:
        try:
            return self.inbox.poll(max(0.0, timeout))
        except (EOFError, OSError):
            return True  # recv() will report the dead child

    def _recv(self, index: int):
        try:
            return self.inbox.recv()
        except (EOFError, OSError):
            code = self.proc.wait() if self.proc is not None else None
            self.stop()
            raise GraderError(f"grading worker exited (code {code}) on sample {index}") from None

    def grade(self, spec: str, items: Sequence[tuple], kwargs: dict, timeout_s: float,
              result: str = "float", item_kwargs: Optional[Sequence[dict]] = None) -> tuple[list, list[int]]:
        """Scores of ``items`` and the indices that ran past ``timeout_s`` (scored 0); with
        ``result="text"`` the function's return values as strings (None where it ran late).
        ``item_kwargs``: keywords of each item's call of its own (a record's dataset columns)."""
        if os.getpid() != self.owner:  # forked: the child process belongs to the parent
            self.proc, self.owner = None, os.getpid()
        scores: list = [0.0 if result == "float" else None] * len(items)
        timed_out: list[int] = []
        done = 0
        while done < len(items):
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            own = list(item_kwargs[done:]) if item_kwargs is not None else None
            self.outbox.send(("grade", spec, kwargs, list(items[done:]), result, own))
            if not self._wait(STARTUP_TIMEOUT_S):
                self.stop()
                raise GraderError(f"grading worker did not load {spec} within {STARTUP_TIMEOUT_S:.0f} s")
            ready = self._recv(done)
            if ready[0] != "ready":
                self.stop()
                raise GraderError(f"grading worker cannot run {spec}: {ready[1]}")
            base = done
            deadline = time.monotonic() + timeout_s
            while done < len(items):
                if not self._wait(deadline - time.monotonic()):
                    self.stop()
                    timed_out.append(done)
                    done += 1
                    break
                _, offset, ok, value = self._recv(done)
                if not ok:
                    self.stop()  # it is still grading the rest of the batch
                    raise GraderError(f"{value} (sample {base + offset})", detail=value)
                scores[base + offset] = value
                done = base + offset + 1
                deadline = time.monotonic() + timeout_s
        return scores, timed_out


_LOCAL = threading.local()


def _thread_worker() -> Worker:
    worker = getattr(_LOCAL, "worker", None)
    if worker is None:
        worker = _LOCAL.worker = Worker()
    return worker


def bounded_map(score: Callable, items: Sequence[tuple], kwargs: Optional[dict] = None,
                timeout_s: Optional[float] = DEFAULT_TIMEOUT_S, workers: int = 1,
                item_kwargs: Optional[Sequence[dict]] = None) -> Scores:
    """``score(*item, **item_kwargs[i], **kwargs)`` for every item, each bounded by ``timeout_s`` seconds.

    ``timeout_s=None`` grades in this process without a bound (for benchmarks and debugging).
    ``workers > 1`` splits the items round-robin over that many child processes graded at once."""
    kwargs = dict(kwargs or {})
    if not items:
        return Scores()
    own = list(item_kwargs) if item_kwargs is not None else [{}] * len(items)
    if timeout_s is None:
        return Scores([float(score(*item, **mine, **kwargs)) for item, mine in zip(items, own)])
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    spec = grader_spec(score)
    workers = max(1, min(int(workers), len(items)))
    if workers == 1:
        values, late = _thread_worker().grade(spec, items, kwargs, timeout_s, item_kwargs=own)
        return Scores(values, len(late))
    shares = [list(range(w, len(items), workers)) for w in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        outs = list(pool.map(lambda idx: _thread_worker().grade(spec, [items[i] for i in idx], kwargs, timeout_s,
                                                                 item_kwargs=[own[i] for i in idx]), shares))
    values = [0.0] * len(items)
    for idx, (share_values, _) in zip(shares, outs):
        for i, v in zip(idx, share_values):
            values[i] = v
    return Scores(values, sum(len(late) for _, late in outs))


@atexit.register
def _stop_all() -> None:
    for worker in list(_LIVE):
        worker.stop()
