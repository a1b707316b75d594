"""Run a function on N gloo worker processes and collect per-rank results.

This is for parallel tests and benchmarks of code built on megatron_rl, ours (``tests/``,
``benchmarks/``) and yours: it needs no GPU, no launcher and no cluster, only CPU cores.

    from megatron_rl.testing.harness import run_distributed

    def body(tp):                       # module level: see below
        from megatron_rl.testing.layouts import use_layout

        layout = use_layout(tp=tp)
        return layout.dp

    def test_dp_size():
        assert run_distributed(4, body, 2) == [2, 2, 2, 2]    # one entry per rank

One shared pool per world size serves the whole session: workers are forked from a forkserver
that has already imported torch and megatron-core, initialise torch.distributed once, and then
run any number of bodies (each may set up its own parallel layout with
:func:`megatron_rl.testing.layouts.use_layout`).  A body that raises on any rank fails the caller
with that rank's traceback; a body that hangs is killed after ``timeout`` seconds and the pool is
rebuilt, so one bad test never blocks the rest.

What this design costs:

* The body and its arguments are pickled, and a function pickles *by reference* (its module and
  name).  So a body must be a module-level function of an importable module (no lambdas, no
  nested functions, no functions defined in ``__main__`` of a script the workers cannot import),
  and its return value must pickle.  Bodies import what they use inside themselves, which also
  keeps collecting a test file cheap.
* Workers are reused, so whatever a body leaves in module globals reaches the next body in that
  pool.  :func:`reset_state` runs before every body: it clears the caches megatron_rl keeps and
  restores the tunables tests lower (``_CACHES``, ``_TUNABLES``).  Anything else a body patches
  (a method, a registry entry) it must restore in ``finally``.  For fresh processes, call
  ``get_pool(n).close()``: the next ``get_pool(n)`` starts new workers.
* An idle pool is not free: every worker keeps the gloo process groups of its last layout (about
  30), whose event-loop threads wake a hundred times a second; fourteen idle workers took 45% of a
  core on a 2-core machine.  So a pool idle for ``MEGATRON_RL_TEST_POOL_IDLE_S`` seconds (20) is
  closed by a background thread, and started again, transparently, by its next ``run``: restarting
  costs 2-4 s, idling costs the whole machine a fifth of its CPU for as long as it lasts.
  For the same reason workers exit within a second of the process that owns their pool, killed
  or not (a benchmark stopped with Ctrl-C or SIGKILL leaves nothing running).
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

_DEFAULT_TIMEOUT = float(os.environ.get("MEGATRON_RL_TEST_TIMEOUT", "300"))
_IDLE_CLOSE_S = float(os.environ.get("MEGATRON_RL_TEST_POOL_IDLE_S", "20"))

# Process-wide state one body may change and the next should not inherit.  Caches, cleared
# (``cache_clear`` for functools caches, ``clear`` for dicts): (module, attribute, method).
_CACHES = (
    ("megatron_rl.ops.cp_attention", "block_pairs", "cache_clear"),
    ("megatron_rl.ops.cp_attention", "_global_positions", "cache_clear"),
    ("megatron_rl.ops.cp_attention", "a2a_order", "cache_clear"),
    ("megatron_rl.ops.packed_attention", "_plan", "cache_clear"),
)
# Tunables tests lower, set back to their values when the worker started: (module, attribute).
_TUNABLES = (("megatron_rl.ops.packed_attention", "MAX_PADDING_WASTE"),)
_DEFAULTS: dict[tuple[str, str], Any] = {}


class RankError(RuntimeError):
    """A test body raised on a worker rank."""


def reset_state() -> None:
    """Clear megatron_rl's process-wide caches and restore the tunables tests change.

    The worker runs it before every body.  tests/test_runtime.py checks that every name in
    ``_CACHES`` and ``_TUNABLES`` still exists, so a rename cannot make this a silent no-op."""
    import importlib

    for module, attr, method in _CACHES:
        getattr(getattr(importlib.import_module(module), attr), method)()
    for module, attr in _TUNABLES:
        mod = importlib.import_module(module)
        setattr(mod, attr, _DEFAULTS.setdefault((module, attr), getattr(mod, attr)))


def _exit_with_owner(owner: int, every_s: float = 1.0) -> None:
    """End this worker once ``owner`` (the process whose pool it is) is gone.  A killed owner runs
    no ``atexit``, and its queues stay open in the worker itself, so without this the worker would
    finish its body and then wait forever, its process groups' threads taking CPU meanwhile."""
    def watch() -> None:
        while True:
            time.sleep(every_s)
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # alive, another user's: cannot be ours
                pass

    threading.Thread(target=watch, name="pool-owner-watch", daemon=True).start()


def _worker_main(rank: int, world: int, port_file: str, tasks, results, owner: int) -> None:
    from megatron_rl.distributed.env import PORT_FILE_ENV

    _exit_with_owner(owner)

    # Port 0: rank 0 binds one the kernel picks and publishes it in port_file (pools started at once never clash).
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="0", MEGATRON_RL_LAUNCHER="test", **{PORT_FILE_ENV: port_file},
    )
    try:
        from megatron_rl.config.schema import DistributedConfig
        from megatron_rl.distributed.runtime import init_distributed

        init_distributed(DistributedConfig(timeout_s=int(_DEFAULT_TIMEOUT)))
        reset_state()  # before any body: records the tunables' defaults
    except BaseException:  # noqa: BLE001 - reported to the test process, which raises it
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        try:
            item = tasks.get()
        except (EOFError, OSError):  # the test process is gone
            break
        if item is None:
            break
        task_id, path, payload = item
        for entry in path:
            if entry not in sys.path:
                sys.path.append(entry)
        try:
            reset_state()
            fn, args, kwargs = pickle.loads(payload)
            value = fn(*args, **kwargs)
            results.put((rank, True, (task_id, pickle.dumps(value))))
        except BaseException:  # noqa: BLE001 - reported to the test process, which raises it
            results.put((rank, False, (task_id, traceback.format_exc())))


class WorkerPool:
    def __init__(self, world_size: int, timeout: float = _DEFAULT_TIMEOUT):
        self.world_size = world_size
        self.timeout = timeout
        self._lock = threading.RLock()  # run and the idle reaper's close never overlap
        self._start()

    def _start(self) -> None:
        self.closed = False
        self.idle_since = time.monotonic()
        world_size = self.world_size
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["megatron_rl.testing.preload"])
        # Not daemonic: megatron's checkpoint writer starts helper processes of its own.
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._rendezvous = tempfile.TemporaryDirectory(prefix="megatron_rl_pool_")
        port_file = os.path.join(self._rendezvous.name, "port")
        self._procs = [
            ctx.Process(
                target=_worker_main, args=(r, world_size, port_file, self._tasks[r], self._results, os.getpid()),
                daemon=False
            )
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._next_id = 0
        for _ in range(world_size):
            rank, ok, info = self._get(self.timeout)
            if not ok:
                self.close()
                raise RankError(f"worker rank {rank} failed to start:\n{info}")

    def _get(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    what = f"worker exited (code {dead[0].exitcode})" if dead else f"timed out after {timeout:.0f}s"
                    raise RankError(f"test pool of {self.world_size}: {what}") from None

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank return values (a pool closed
        while idle starts again first)."""
        with self._lock:
            if self.closed:
                self._start()
            try:
                return self._run(fn, args, kwargs, timeout)
            finally:
                self.idle_since = time.monotonic()

    def close_if_idle(self, idle_s: float) -> None:
        """Close the workers when no body ran for ``idle_s`` seconds (never while one runs)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self.closed and time.monotonic() - self.idle_since > idle_s:
                    self.close()
            finally:
                self._lock.release()

    def _run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float | None) -> list[Any]:
        self._next_id += 1
        task_id = self._next_id
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((task_id, list(sys.path), payload))
        values: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = self.world_size
        grace_deadline = None
        limit = timeout or self.timeout
        while pending:
            wait = limit if grace_deadline is None else max(0.01, grace_deadline - time.monotonic())
            try:
                rank, ok, info = self._get(wait)
            except RankError as err:
                if errors:
                    break  # other ranks are stuck in a collective after a failure: pool is gone
                raise RankError(f"{fn.__module__}.{fn.__qualname__}: {err}") from None
            got_id, body = info
            if got_id != task_id:
                continue
            pending -= 1
            if ok:
                values[rank] = pickle.loads(body)
            else:
                errors[rank] = body
                # Give the other ranks a moment to fail too, then stop waiting for them.
                grace_deadline = grace_deadline or time.monotonic() + 10.0
        if errors:
            if pending:
                self.close()
            first = min(errors)
            raise RankError(f"{fn.__qualname__} raised on rank {first}:\n{errors[first]}")
        return values

    def close(self) -> None:
        self.closed = True
        for q in self._tasks:
            try:
                q.put_nowait(None)
            except (ValueError, OSError, queue.Full):  # closed already, or the worker is gone
                pass
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        self._rendezvous.cleanup()


_POOLS: dict[int, WorkerPool] = {}


_REAPER: threading.Thread | None = None


def _close_idle_pools() -> None:
    while True:
        time.sleep(max(1.0, _IDLE_CLOSE_S / 4))
        for pool in list(_POOLS.values()):
            pool.close_if_idle(_IDLE_CLOSE_S)


def get_pool(world_size: int) -> WorkerPool:
    global _REAPER
    pool = _POOLS.get(world_size)
    if pool is None or not (pool.closed or pool.alive):
        pool = _POOLS[world_size] = WorkerPool(world_size)
    if _REAPER is None and _IDLE_CLOSE_S > 0:
        _REAPER = threading.Thread(target=_close_idle_pools, name="megatron_rl_pool_reaper", daemon=True)
        _REAPER.start()
    return pool


def importable_script(file: str, spec=None):
    """The module of a script run as ``python path/to/script.py`` (``__file__``, ``__spec__``),
    imported under its own name with its folder on ``sys.path``, so that workers can unpickle
    the functions it hands to a pool (those of ``__main__`` they cannot)."""
    import importlib
    import os
    import sys

    if spec is not None and spec.name != "__main__":
        return importlib.import_module(spec.name)
    here = os.path.dirname(os.path.abspath(file))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(os.path.splitext(os.path.basename(file))[0])


def run_distributed(world_size: int, fn: Callable, *args, **kwargs) -> list[Any]:
    """Shorthand for ``get_pool(world_size).run(fn, ...)``."""
    return get_pool(world_size).run(fn, *args, **kwargs)


@atexit.register
def close_all_pools() -> None:
    """Stop every pool's workers (the next ``get_pool`` starts fresh ones).

    Idle workers are not free: each keeps the gloo process groups of its last layout, and gloo's
    loop threads wake periodically.  A test that times a job of its own processes (the README
    demo) closes the pools first, so the job gets the cores."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()
