"""The job's TCP store for ranks started on this machine, on a port no other job can take first.

Picking a free port and binding it later (as ``MASTER_PORT`` usually works) leaves seconds -- rank 0
imports torch in between -- in which another job, or any process binding port 0, can take it; rank
0 then dies with EADDRINUSE.  Here rank 0 binds port 0 itself, so the kernel hands it a free port
atomically, and publishes the number in a file the launcher named (``MEGATRON_RL_PORT_FILE``); the
other ranks read it there.  Under torchrun or srun the port is the user's ``MASTER_PORT``.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from megatron_rl.utils import run_files

_POLL_S = 0.02


def _published(path: str, timeout: datetime.timedelta) -> int:
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            with open(path) as fh:
                return int(fh.read())
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not publish the job's port in {path} within distributed.timeout_s "
                                   f"({timeout.total_seconds():.0f}s); see rank 0's error") from None
            time.sleep(_POLL_S)


def published_store(addr: str, rank: int, port_file: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0 serves the store on a port the kernel picks and publishes it; the others join it."""
    common = dict(timeout=timeout, wait_for_workers=False, multi_tenant=True)
    if rank == 0:
        store = dist.TCPStore(addr, 0, is_master=True, **common)
        run_files.replace_text(port_file, str(store.port), "the job's port")  # never read half-written
        return store
    return dist.TCPStore(addr, _published(port_file, timeout), is_master=False, **common)
