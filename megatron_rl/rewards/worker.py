"""The grading child process of :mod:`megatron_rl.rewards.bounded`.

Reads ``("path", sys_path)`` and ``("grade", spec, kwargs, items)`` messages; for a batch it
imports the grader (and calls its ``prepare`` attribute, if any), answers ``("ready",)`` (or
``("error", why)``), then sends one ``("score", i, ok, value)`` per item.  The parent kills it when
an item overruns; it exits by itself when the parent's end of the pipe closes.
"""

from __future__ import annotations

import importlib
import signal
import sys
from multiprocessing.connection import Connection


def _resolve(spec: str):
    module_name, _, qualname = spec.partition(":")
    obj = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    return obj


def main(read_fd: int, write_fd: int) -> None:
    # Ctrl-C reaches the whole process group; the parent stops this process itself (or it sees EOF).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):
            return
        if message[0] == "path":
            sys.path.extend(p for p in message[1] if p not in sys.path)
            continue
        _, spec, kwargs, items = message
        try:
            score = _resolve(spec)
            prepare = getattr(score, "prepare", None)
            if prepare is not None:
                prepare()  # heavy imports happen before the first sample's clock starts
        except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it
            outbox.send(("error", f"{type(err).__name__}: {err}"))
            continue
        outbox.send(("ready",))
        for i, item in enumerate(items):
            try:
                outbox.send(("score", i, True, float(score(*item, **kwargs))))
            except Exception as err:  # noqa: BLE001 - the parent names the sample and raises
                outbox.send(("score", i, False, f"{type(err).__name__}: {err}"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
