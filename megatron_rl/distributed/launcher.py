"""Start N ranks on this machine and watch them (``megatron-rl <command> --nproc N``).

Each rank is this same command line run again with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set.
The launcher polls the ranks; when one fails it stops the others (SIGTERM, then SIGKILL),
prints the first failure once (a one-line diagnosis, exit code 2, before any traceback), and
returns that rank's exit code.  A rank stuck in a
collective with a dead peer is covered by the process-group timeout, so the job always ends.

Signals: SIGTERM, SIGUSR1 and a first Ctrl-C are passed to each rank's main process only (never to
the helper processes it started, such as megatron's checkpoint writers, which must live to finish
the checkpoint); the ranks checkpoint at the next step boundary and exit 0.  A second Ctrl-C or
SIGTERM, or ranks still running ``grace_s`` after the first, end the job at once.  Every rank runs
in its own process group, and each group is killed when the job ends, whatever state its leader is
in, so no helper outlives the job holding its output open; a rank whose launcher dies (even by
SIGKILL) is sent SIGTERM by the kernel (``PR_SET_PDEATHSIG``).

``MEGATRON_RL_FORK_RANKS=1`` starts each rank as a fork of the launcher instead of a new interpreter:
for a launcher that has imported torch and megatron-core already and done nothing else with them
(a test suite's CLI fork server, :mod:`megatron_rl.testing.cli_runner`), where a new interpreter's
imports are most of a small job's time.  The rank is the same command in a process of its own:
its own session, environment, exit code, and the interpreter's normal exit (non-daemon threads
joined, atexit handlers run).
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from megatron_rl.distributed.env import PORT_FILE_ENV
from megatron_rl.distributed.guard import ERROR_FILE_ENV, done_file
from megatron_rl.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from megatron_rl.utils.phase import phase_file

FORK_RANKS_ENV = "MEGATRON_RL_FORK_RANKS"
CLI_MODULE = "megatron_rl.tools.cli"
POLL_S = 0.1
GRACE_S = 5.0
STOP_GRACE_S = 600.0  # default time the ranks get to checkpoint and exit after a stop signal


def _stop(procs: list[subprocess.Popen], sig=signal.SIGTERM) -> None:
    """``sig`` to every rank's process group: the rank and every helper it started, also when the
    rank itself has exited and left them behind."""
    for proc in procs:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _ask(procs: list[subprocess.Popen], sig: int) -> None:
    """``sig`` to each running rank's main process only."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _end_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every group, a short grace, then SIGKILL; waits for the ranks."""
    _stop(procs)
    deadline = time.monotonic() + GRACE_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    _stop(procs, signal.SIGKILL)
    for p in procs:
        p.wait()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies (Linux); nothing elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _first_failure(err_base: str) -> dict | None:
    records = []
    for path in glob.glob(err_base + ".rank*"):
        try:
            with open(path) as fh:
                records.append(json.load(fh))
        except (OSError, ValueError):
            continue
    # A one-line diagnosis (exit code 2: bad input, a full disk) names the cause; the tracebacks
    # of other ranks at the same moment are its consequence (a peer that left mid-collective).
    return min(records, key=lambda r: (r["exit_code"] != EXIT_BAD_INPUT, r["time"])) if records else None


def _last_phase(err_base: str, rank: int) -> str:
    try:
        with open(phase_file(err_base, rank)) as fh:
            return fh.read().strip() or "starting"
    except OSError:
        return "starting"


class _ForkedRank:
    """What the launcher reads of a rank forked from it: ``subprocess.Popen``'s ``pid``, ``poll``,
    ``wait`` and ``returncode`` (negative: the signal that ended it)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def _reap(self, flags: int):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self):
        return self._reap(os.WNOHANG)

    def wait(self, timeout=None):
        return self._reap(0)


def _exit_code(err: SystemExit) -> int:
    """The exit status ``python`` gives a ``SystemExit``: None 0, an int itself, anything else printed, 1."""
    if err.code is None or isinstance(err.code, int):
        return err.code or 0
    print(err.code, file=sys.stderr)
    return 1


def _forked_rank_main(argv: list[str], env: dict) -> None:
    """In the forked child: run ``megatron-rl <argv>`` as the new interpreter would, then exit."""
    code = 1
    try:
        os.setsid()
        _die_with_parent()
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        atexit._clear()  # the launcher's handlers are not the rank's
        _fresh_standard_streams()
        run_cli_module(argv)
        code = 0
    except SystemExit as err:
        code = _exit_code(err)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # the interpreter's exit: non-daemon threads first, then atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _fresh_standard_streams() -> None:
    """Text streams on file descriptors 0, 1 and 2, as a new interpreter has: the launcher's may be
    objects without a descriptor (a test's captured output), where what a rank writes would stay in
    the child's memory and ``faulthandler.enable()`` (which megatron-core calls on import) raises."""
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        try:
            stream = open(fd, mode, closefd=False, buffering=1 if fd == 2 else -1,
                          errors="backslashreplace" if fd == 2 else None)
        except OSError:  # a descriptor the launcher was started without
            continue
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_cli_module(argv: list[str]) -> None:
    """``python -m megatron_rl.tools.cli <argv>`` in this process (by name: the launcher sits below
    the command-line layer), as ``__main__``; it ends by raising ``SystemExit``."""
    import runpy

    sys.argv = [CLI_MODULE, *argv]
    sys.modules.pop(CLI_MODULE, None)  # python -m runs a fresh copy as __main__
    package, _, name = CLI_MODULE.rpartition(".")
    if hasattr(sys.modules.get(package), name):
        delattr(sys.modules[package], name)
    runpy.run_module(CLI_MODULE, run_name="__main__", alter_sys=True)


def _fork_rank(argv: list[str], env: dict) -> _ForkedRank:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _forked_rank_main(argv, env)
    return _ForkedRank(pid)


def _start_ranks(argv: list[str], nproc: int, extra_env: dict | None, err_base: str) -> list:
    """Each rank: this command line again, in a session of its own, with its rendezvous environment."""
    fork = os.environ.get(FORK_RANKS_ENV) == "1"
    procs = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(extra_env or {})
        env.update(
            RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
            # Port 0: rank 0 binds one the kernel picks and publishes it (no pick-then-bind race).
            MASTER_ADDR="127.0.0.1", MASTER_PORT="0", MEGATRON_RL_LAUNCHER="local",
            **{ERROR_FILE_ENV: err_base, PORT_FILE_ENV: f"{err_base}.port"},
        )
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        if fork:
            procs.append(_fork_rank(argv, env))
            continue
        procs.append(subprocess.Popen([sys.executable, "-m", CLI_MODULE, *argv],
                                      env=env, start_new_session=True, preexec_fn=_die_with_parent))
    return procs


class _StopSignals:
    """The launcher's SIGINT/SIGTERM/SIGUSR1 while the ranks run: the first is passed on to the
    ranks (which checkpoint and exit), a second SIGINT or SIGTERM asks to abort."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs, self.asked, self.abort = procs, None, False
        self._old = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}

    def _forward(self, signum, _frame) -> None:
        if self.asked is not None and signum in (signal.SIGINT, signal.SIGTERM):
            self.abort = True  # the second request: now
            return
        if self.asked is None:
            self.asked = time.monotonic()
        if signum == signal.SIGINT:
            print("Ctrl-C: the ranks stop after this step with a checkpoint (Ctrl-C again aborts without one)",
                  file=sys.stderr, flush=True)
        _ask(self.procs, signal.SIGTERM if signum == signal.SIGINT else signum)

    def restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


class _Ranks:
    """The running ranks of one job and what they left in its error files."""

    def __init__(self, procs: list[subprocess.Popen], err_base: str, rank_names: dict[int, str]):
        self.procs, self.err_base, self.names = procs, err_base, rank_names

    def named(self, rank: int) -> str:
        return f"rank {rank} ({self.names[rank]})" if rank in self.names else f"rank {rank}"

    def left_early(self, rank: int) -> bool:
        """Exit code 0 without the mark a finished rank writes (a C library's exit(0))."""
        return self.procs[rank].returncode == 0 and not os.path.exists(done_file(self.err_base, rank))


def _watch(ranks: _Ranks, stop: _StopSignals, grace_s: float) -> int | None:
    """Poll until every rank finished (0), the job is aborted (its exit code), or a rank failed (None)."""
    procs = ranks.procs
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) or c == 0 and ranks.left_early(r) for r, c in enumerate(codes)):
            return None
        if all(c == 0 for c in codes):
            _stop(procs, signal.SIGKILL)  # helpers the ranks left behind
            return 0
        late = stop.asked is not None and time.monotonic() - stop.asked > grace_s
        if stop.abort or late:
            why = ("a second stop signal" if stop.abort
                   else f"the ranks were still running {grace_s:.0f} s after the stop signal")
            print(f"megatron-rl: aborting the job ({why}); no checkpoint of the current step",
                  file=sys.stderr, flush=True)
            _end_all(procs)
            return EXIT_INTERRUPTED if stop.abort else 1
        time.sleep(POLL_S)


def _report_failure(ranks: _Ranks) -> int:
    """End every rank, print the failure that caused the others, and return the job's exit code."""
    procs, nproc, named = ranks.procs, len(ranks.procs), ranks.named
    # Ranks killed by a signal before we sent any (OOM killer, kill -9) are the root cause:
    # their peers' errors are only the broken connections that followed.
    time.sleep(POLL_S)
    codes = [p.poll() for p in procs]
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
    early = [r for r, c in enumerate(codes) if c == 0 and ranks.left_early(r)]
    _end_all(procs)
    record = _first_failure(ranks.err_base)
    if early and not killed and record is None:
        rank = early[0]
        print(f"megatron-rl: {named(rank)} exited with code 0 before its work was done (in "
              f"{_last_phase(ranks.err_base, rank)}): a reward function, tool or library it runs ended the process "
              f"without an error; stopped the other {nproc - 1} rank(s)", file=sys.stderr, flush=True)
        return 1
    if killed or record is None:
        rank = killed[0] if killed else next(r for r, c in enumerate(codes) if c not in (None, 0))
        code = procs[rank].returncode
        reason = f"signal {-code}" if code < 0 else f"exit code {code}"
        print(f"megatron-rl: {named(rank)} died ({reason}) without a Python traceback; "
              f"stopped the other {nproc - 1} rank(s)", file=sys.stderr, flush=True)
        if record is not None:
            last = record["message"].strip().splitlines()[-1]
            print(f"  then {named(record['rank'])} failed: {last}", file=sys.stderr, flush=True)
        return code if code > 0 else 1
    print(f"megatron-rl: {named(record['rank'])} failed (exit code {record['exit_code']}); "
          f"stopped the other {nproc - 1} rank(s)\n{record['message']}", file=sys.stderr, flush=True)
    return int(record["exit_code"]) or 1


def launch_local(argv: list[str], nproc: int, extra_env: dict | None = None, grace_s: float = STOP_GRACE_S,
                 rank_names: dict[int, str] | None = None) -> int:
    """Run ``python -m megatron_rl.tools.cli <argv>`` on ``nproc`` ranks; return the job's exit code.
    ``grace_s``: how long the ranks get to checkpoint and exit after a stop signal; ``rank_names``:
    how failure messages name ranks that are not plain training ranks (generator ranks)."""
    tmp = tempfile.mkdtemp(prefix="megatron_rl_launch_")
    err_base = os.path.join(tmp, "error")
    procs = _start_ranks(argv, nproc, extra_env, err_base)
    stop = _StopSignals(procs)
    try:
        ranks = _Ranks(procs, err_base, rank_names or {})
        code = _watch(ranks, stop, grace_s)
        return code if code is not None else _report_failure(ranks)
    finally:
        stop.restore()
        for path in glob.glob(err_base + "*"):
            os.unlink(path)
        os.rmdir(tmp)
