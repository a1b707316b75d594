"""Run a rank's work so that a failure ends the job instead of hanging it.

On an exception the rank writes its traceback (with the time it failed) to the launcher's error
file, or to stderr when no launcher is watching, and leaves with ``os._exit``: no atexit handler
or process-group teardown that could block on a collective.  The launcher then stops the other
ranks and prints the first failure once.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Callable

from megatron_rl.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, UserInputError

ERROR_FILE_ENV = "MEGATRON_RL_ERROR_FILE"


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
        text = str(exc)
    else:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
        if _lost_a_peer(exc):
            text += (
                f"\nrank {rank} waited longer than distributed.timeout_s for a collective: another rank "
                "is hung or dead (see its log), or the timeout is too short for this step"
            )
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        record = {"rank": rank, "time": time.time(), "exit_code": code, "message": text}
        with open(f"{path}.rank{rank}", "w") as fh:
            json.dump(record, fh)
    else:
        print(f"[rank {rank}] {text}" if not isinstance(exc, UserInputError) else text, file=sys.stderr, flush=True)


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
    os._exit(EXIT_INTERRUPTED)


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    _reap_children()
    os._exit(code)


def exit_with_error(exc: BaseException) -> None:
    """Report ``exc`` as this rank's failure and end the process now (from any thread): for a
    watchdog whose main thread is stuck where no exception can reach it."""
    code = EXIT_BAD_INPUT if isinstance(exc, UserInputError) else 1
    report_failure(exc, code)
    _exit(code)


def run_guarded(fn: Callable[[], int | None]) -> None:
    """Call ``fn``; exit with its code, or report and ``os._exit`` on any exception."""
    try:
        code = fn() or 0
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
