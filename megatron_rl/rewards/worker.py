"""The child process of :mod:`megatron_rl.rewards.bounded`: graders, and the tools of multi-turn
environments (:mod:`megatron_rl.envs.tools`).

Reads ``("path", sys_path)``, ``("sandbox", directory)`` and ``("grade", spec, kwargs, items,
result, item_kwargs)`` messages (``item_kwargs``: None, or one dict of keywords per item, such as a
record's dataset columns); for a batch it imports the function (and calls its ``prepare`` attribute, if
any), answers ``("ready",)`` (or ``("error", why)``), then sends one ``("score", i, ok, value)`` per
item, the value a float (``result="float"``, graders) or a string (``"text"``, tools).  The parent
kills it when an item overruns; it exits by itself when the parent's end of the pipe closes.

``sandbox`` (tools): the process works in ``directory`` (its only writable place by convention:
``HOME`` and ``TMPDIR`` point there) and every socket call raises, so a tool cannot reach the
network.  It is a Python-level fence for the built-in tools and well-behaved user tools, not an
operating-system sandbox: code that means harm can undo it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from multiprocessing.connection import Connection

from megatron_rl.rewards.locations import import_spec


def _no_network(*args, **kwargs):
    raise PermissionError("tools run without network access")


def enter_sandbox(directory: str) -> None:
    """Work in ``directory`` with no network (see the module docstring)."""
    os.makedirs(directory, exist_ok=True)
    os.chdir(directory)
    os.environ["HOME"] = os.environ["TMPDIR"] = directory
    for name in ("socket", "create_connection", "getaddrinfo", "socketpair", "fromfd", "create_server"):
        setattr(socket, name, _no_network)


def _convert(value, result: str):
    return float(value) if result == "float" else str(value)


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
        if message[0] == "sandbox":
            enter_sandbox(message[1])
            continue
        _, spec, kwargs, items, result, item_kwargs = message
        try:
            score = import_spec(spec)
            prepare = getattr(score, "prepare", None)
            if prepare is not None:
                prepare()  # heavy imports happen before the first sample's clock starts
        except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it
            outbox.send(("error", f"{type(err).__name__}: {err}"))
            continue
        outbox.send(("ready",))
        for i, item in enumerate(items):
            try:
                own = item_kwargs[i] if item_kwargs else {}
                outbox.send(("score", i, True, _convert(score(*item, **own, **kwargs), result)))
            except Exception as err:  # noqa: BLE001 - the parent names the sample and raises
                outbox.send(("score", i, False, f"{type(err).__name__}: {err}"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
