"""Run a rank's work so that a failure ends the job instead of hanging it.

On an exception the rank writes its traceback (with the time it failed) to the launcher's error
file, or to stderr when no launcher is watching, and leaves with ``os._exit``: no atexit handler
or process-group teardown that could block on a collective.  The launcher then stops the other
ranks and prints the first failure once.

A rank that ends before its work is done is a failure, also with exit code 0: while the work
runs, ``os._exit`` called in this process (by a reward function, a tool, a library they import)
reports the call site and the phase (:mod:`megatron_rl.utils.phase`) and exits 1; a rank that
finishes writes ``<error file>.done.rank<r>``, so the launcher can tell a rank that vanished with
code 0 (a C library's ``exit(0)``) from one that finished.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Callable

from megatron_rl.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, UserInputError
from megatron_rl.utils import phase
from megatron_rl.utils.phase import ERROR_FILE_ENV

# Ask a job to checkpoint and exit 0 (a scheduler's preemption notice, Ctrl-C), on any of its ranks.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_REAL_EXIT = os._exit  # ours to leave by; os._exit itself is watched while the work runs
_watched_pid: list[int] = []


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def _lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is torch.distributed giving up on another rank.

    NCCL (watchdog timeouts), the TCP store and the network layer raise the typed
    ``torch.distributed.DistError`` subclasses.  gloo does not: in torch 2.13 a gloo collective
    that times out raises a plain ``RuntimeError`` ("Timed out waiting ...ms for recv"), so its
    text is the fallback.
    """
    import torch.distributed as dist

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, dist.DistError) or "timed out" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def report_failure(exc: BaseException, code: int) -> None:
    rank = _rank()
    if isinstance(exc, UserInputError):
        _report(str(exc), code, one_line=True)
        return
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    if _lost_a_peer(exc):
        text += (
            f"\nrank {rank} waited longer than distributed.timeout_s for a collective: another rank "
            "is hung or dead (see its log), or the timeout is too short for this step"
        )
    _report(text, code, one_line=False)


def _report(text: str, code: int, one_line: bool) -> None:
    """To the launcher's error file, or to stderr when no launcher is watching."""
    rank = _rank()
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        record = {"rank": rank, "time": time.time(), "exit_code": code, "message": text}
        with open(f"{path}.rank{rank}", "w") as fh:
            json.dump(record, fh)
    else:
        print(text if one_line else f"[rank {rank}] {text}", file=sys.stderr, flush=True)


def done_file(base: str, rank: int) -> str:
    return f"{base}.done.rank{rank}"


def _exit_called_early(code=0) -> None:
    """``os._exit`` while this rank's work runs: report who called it and what the rank was doing."""
    if not _watched_pid or os.getpid() != _watched_pid[0]:  # a forked child leaving as it should
        _REAL_EXIT(code)
    frame = traceback.extract_stack(limit=2)[0]  # the caller of os._exit
    exit_code = code if isinstance(code, int) and code > 0 else 1
    _report(f"rank {_rank()} ended early: os._exit({code!r}) was called at {frame.filename}:{frame.lineno} "
            f"in {frame.name}() while in {phase.describe()}; fix: a reward function, tool or library this rank "
            "runs ended the process -- make it return or raise instead", exit_code, one_line=True)
    _exit(exit_code)


def watch_early_exit() -> None:
    """Until :func:`stop_watching`: ``os._exit`` in this process is a reported failure (exit 1 for 0)."""
    _watched_pid[:] = [os.getpid()]
    os._exit = _exit_called_early
    phase.at_step(None)


def stop_watching() -> None:
    _watched_pid.clear()
    os._exit = _REAL_EXIT


def _reap_children() -> None:
    """Stop helper processes this rank started (e.g. megatron's checkpoint-writer queue manager).

    ``os._exit`` skips the interpreter's exit handlers that would stop them; left alone they
    outlive the job and keep its output pipes open."""
    try:
        import psutil
    except ImportError:
        return
    try:
        children = psutil.Process().children(recursive=True)
        for child in children:
            # multiprocessing's resource tracker ignores SIGTERM: waiting for it added the whole
            # timeout to every exit.  It would be killed after it anyway.
            if _is_resource_tracker(child):
                child.kill()
            else:
                child.terminate()
        _, alive = psutil.wait_procs(children, timeout=3)
        for child in alive:
            child.kill()
    except psutil.Error:  # processes already gone
        pass


def _is_resource_tracker(proc) -> bool:
    import psutil

    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def abort_now(message: str) -> None:
    """End this rank at once, from a signal handler (a second Ctrl-C): helper processes are killed
    first, then the rank exits 130 with ``message``.  No exception unwinds through the code that
    was running, which may be waiting on a helper (megatron's checkpoint writer starting up prints
    a BrokenPipe traceback when its parent's end of the pipe closes under it)."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            child.kill()
    except (ImportError, Exception):  # noqa: BLE001 - psutil missing or a child already gone: exit anyway
        pass
    print(f"[rank {_rank()}] {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    _REAL_EXIT(EXIT_INTERRUPTED)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    _reap_children()
    _REAL_EXIT(code)


def exit_with_error(exc: BaseException) -> None:
    """Report ``exc`` as this rank's failure and end the process now (from any thread): for a
    watchdog whose main thread is stuck where no exception can reach it."""
    code = EXIT_BAD_INPUT if isinstance(exc, UserInputError) else 1
    report_failure(exc, code)
    _exit(code)


def run_guarded(fn: Callable[[], int | None]) -> None:
    """Call ``fn``; exit with its code, or report and ``os._exit`` on any exception."""
    watch_early_exit()
    try:
        code = fn() or 0
        stop_watching()
        path = os.environ.get(ERROR_FILE_ENV)
        if path:  # the launcher tells a finished rank from one that left early with code 0
            with open(done_file(path, _rank()), "w") as fh:
                fh.write(str(code))
    except UserInputError as exc:
        report_failure(exc, EXIT_BAD_INPUT)
        _exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:  # a second Ctrl-C: the user asked to stop now, not for a traceback
        print(f"[rank {_rank()}] aborted (Ctrl-C twice); no checkpoint of the current step", file=sys.stderr,
              flush=True)
        _exit(EXIT_INTERRUPTED)
    except BaseException as exc:  # noqa: BLE001 - every failure must end the rank
        report_failure(exc, 1)
        _exit(1)
    _exit(code)
