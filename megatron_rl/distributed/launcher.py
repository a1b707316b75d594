"""Start N ranks on this machine and watch them (``megatron-rl <command> --nproc N``).

Each rank is this same command line run again with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set.
The launcher polls the ranks; when one fails it stops the others (SIGTERM, then SIGKILL),
prints the first failure's traceback once, and returns that rank's exit code.  A rank stuck in a
collective with a dead peer is covered by the process-group timeout, so the job always ends.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from megatron_rl.distributed.env import free_port
from megatron_rl.distributed.guard import ERROR_FILE_ENV

POLL_S = 0.1
GRACE_S = 5.0


def _stop(procs: list[subprocess.Popen], sig=signal.SIGTERM) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _first_failure(err_base: str) -> dict | None:
    records = []
    for path in glob.glob(err_base + ".rank*"):
        try:
            with open(path) as fh:
                records.append(json.load(fh))
        except (OSError, ValueError):
            continue
    return min(records, key=lambda r: r["time"]) if records else None


def launch_local(argv: list[str], nproc: int, extra_env: dict | None = None) -> int:
    """Run ``python -m megatron_rl.tools.cli <argv>`` on ``nproc`` ranks; return the job's exit code."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="megatron_rl_launch_")
    err_base = os.path.join(tmp, "error")
    procs = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(extra_env or {})
        env.update(
            RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MEGATRON_RL_LAUNCHER="local",
            **{ERROR_FILE_ENV: err_base},
        )
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_rl.tools.cli", *argv],
                                      env=env, start_new_session=True))

    def _forward(signum, _frame):
        _stop(procs, signal.SIGTERM if signum == signal.SIGINT else signum)

    old = {s: signal.signal(s, _forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                break
            if all(c == 0 for c in codes):
                return 0
            time.sleep(POLL_S)
        # Ranks killed by a signal before we sent any (OOM killer, kill -9) are the root cause:
        # their peers' errors are only the broken connections that followed.
        time.sleep(POLL_S)
        codes = [p.poll() for p in procs]
        killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
        _stop(procs)
        deadline = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        _stop(procs, signal.SIGKILL)
        for p in procs:
            p.wait()
        record = _first_failure(err_base)
        if killed or record is None:
            rank = killed[0] if killed else next(r for r, c in enumerate(codes) if c not in (None, 0))
            code = procs[rank].returncode
            reason = f"signal {-code}" if code < 0 else f"exit code {code}"
            print(f"megatron-rl: rank {rank} died ({reason}) without a Python traceback; "
                  f"stopped the other {nproc - 1} rank(s)", file=sys.stderr, flush=True)
            if record is not None:
                last = record["message"].strip().splitlines()[-1]
                print(f"  then rank {record['rank']} failed: {last}", file=sys.stderr, flush=True)
            return code if code > 0 else 1
        print(f"megatron-rl: rank {record['rank']} failed (exit code {record['exit_code']}); "
              f"stopped the other {nproc - 1} rank(s)\n{record['message']}", file=sys.stderr, flush=True)
        return int(record["exit_code"]) or 1
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for path in glob.glob(err_base + "*"):
            os.unlink(path)
        os.rmdir(tmp)
