"""``python -m megatron_rl.tools.cli ARGS`` as a fresh process, without a fresh interpreter's imports.

Every CLI test that starts the real command pays for an interpreter importing torch, megatron-core
and megatron_rl (several seconds on a loaded 2-core machine) before the command does anything.
:func:`run_cli` runs the same module the same way (``runpy``, as ``python -m`` does: ``__main__``,
``sys.argv``, the working directory first on ``sys.path``) in a process *forked* from a server
that has imported those modules once and done nothing else: each call is its own process, with
its own exit code (``sys.exit``, an uncaught exception, a signal), its own stdout and stderr
files, environment and working directory, and the interpreter's normal exit (atexit handlers,
non-daemon threads, flushed output).  It returns a :class:`subprocess.CompletedProcess` like
``subprocess.run(..., capture_output=True, text=True)``.

A ``--nproc N`` command's ranks are forked from the command in turn
(``MEGATRON_RL_FORK_RANKS=1``, :mod:`megatron_rl.distributed.launcher`) unless ``env`` sets it
otherwise: each rank is a process of its own without a new interpreter's imports either.

What it cannot reproduce, and refuses: environment variables an interpreter or a module reads at
start-up (``PYTHON*``, ``MEGATRON_RL_COMPAT_TRACE`` and the ``site/`` hooks') -- use a real
subprocess for those.  Nor does it see warnings the imports themselves print (they were printed
once, by the server): a test that asserts an empty stderr from a cold start needs a real process.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

from megatron_rl.distributed.launcher import CLI_MODULE as MODULE
from megatron_rl.distributed.launcher import FORK_RANKS_ENV, run_cli_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Imported by the server before it forks anything: what every ``train``/``convert``/``generate``
# imports anyway.
PRELOAD = (
    "megatron_rl.testing.preload",
    "megatron_rl.tools.cli",
    "megatron_rl.trainer.ppo",
    "megatron_rl.tools.convert",
    "megatron_rl.tools.generate",
)
# Read when an interpreter or a module starts: a forked child would not see a change.
_STARTUP_ENV = ("MEGATRON_RL_COMPAT_TRACE", "MEGATRON_RL_LONG_TAIL", "MEGATRON_RL_DECODE_FLOOR_S")


def _startup_keys(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith("PYTHON") or k in _STARTUP_ENV}


# ----------------------------------------------------------------------------- the server side


def _stream(fd: int, line_buffering: bool, unbuffered: bool, errors: str):
    import io

    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                            line_buffering=line_buffering, write_through=unbuffered)


def _child(request: dict, reply) -> None:
    """In the forked child: become ``python -m megatron_rl.tools.cli ARGS``.  Never returns normally:
    ``SystemExit`` (or any exception) propagates out of the server's loop, and the interpreter exits
    the way ``python -m`` would."""
    os.setpgid(0, 0)  # the caller can stop the command and whatever it started, and nothing else
    reply.close()  # the server's reply pipe (its request pipe is fd 0, replaced below)
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
    sys.stdout = sys.__stdout__ = _stream(1, False, unbuffered, "strict")
    sys.stderr = sys.__stderr__ = _stream(2, True, unbuffered, "backslashreplace")
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.setdefault(FORK_RANKS_ENV, "1")
    sys.path[0] = os.getcwd()  # python -m: the working directory first
    run_cli_module(request["args"])
    raise SystemExit(0)


def _serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # nothing else may write into the reply pipe
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, reply)
        reply.write(f"pid {pid}\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(f"code {os.waitstatus_to_exitcode(status)}\n")
        reply.flush()


# ----------------------------------------------------------------------------- the test side


class _Server:
    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT"}
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, "--serve"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._buffer = ""
        line = self._line(600)
        if line != "ready":
            raise RuntimeError(f"the CLI fork server did not start (said {line!r}, exit {self.proc.poll()})")

    def _line(self, timeout: float) -> str | None:
        """The next reply line, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while "\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096).decode()
            if not chunk:
                return ""
            self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
        return line

    def run(self, args: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="megatron_rl_cli_") as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            request = {"args": [str(a) for a in args], "env": env, "cwd": str(cwd), "out": out, "err": err}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = int(self._line(60).split()[1])
            line = self._line(timeout)
            if line is None:  # stop the command and everything it started, as subprocess.run's timeout would
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._line(60)
                raise subprocess.TimeoutExpired([sys.executable, "-m", MODULE, *args], timeout,
                                                _read(out), _read(err))
            code = int(line.split()[1])
            return subprocess.CompletedProcess([sys.executable, "-m", MODULE, *args], code, _read(out), _read(err))

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


_SERVER: _Server | None = None


def run_cli(*args, env: dict | None = None, cwd: str = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", "megatron_rl.tools.cli", *args], env=env, cwd=cwd,
    capture_output=True, text=True, timeout=timeout)``, forked from a server that has the imports
    done.  ``env`` is the whole environment (default: this process's, without ``MEGATRON_RL_FAULT``)."""
    global _SERVER
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT"}
    if os.environ.get("MEGATRON_RL_TEST_CLI_FORK") == "0":  # a real interpreter per call (to compare, to debug)
        return subprocess.run([sys.executable, "-m", MODULE, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = _Server()
    if _startup_keys(env) != _startup_keys(_SERVER.env):
        raise ValueError(f"run_cli cannot change start-up variables {_startup_keys(env)}: use a real subprocess")
    return _SERVER.run(list(args), dict(env), cwd, timeout)


def timed_cli(*args, env: dict | None = None, timeout: float = 300):
    """:func:`run_cli` as ``tests/test_cli.py``'s ``cli`` calls it: ``env`` is added to this process's
    environment (``MEGATRON_RL_FAULT`` dropped unless ``env`` sets it); returns (process, seconds)."""
    full = dict(os.environ, **(env or {}))
    if "MEGATRON_RL_FAULT" not in (env or {}):
        full.pop("MEGATRON_RL_FAULT", None)
    start = time.monotonic()
    proc = run_cli(*args, env=full, timeout=timeout)
    return proc, time.monotonic() - start


@atexit.register
def close_server() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.close()
        _SERVER = None


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
