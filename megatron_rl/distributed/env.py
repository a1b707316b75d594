"""Where this process sits in the job: read from torchrun, Slurm's srun, or our local launcher."""

from __future__ import annotations

import dataclasses
import os
import re
import socket


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "local" | "single"


SINGLE = "single"
# Where rank 0 of a local launch publishes the port it bound (:mod:`megatron_rl.distributed.rendezvous`).
PORT_FILE_ENV = "MEGATRON_RL_PORT_FILE"


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist like ``node[01-04,07],gpu5`` (no scontrol needed)."""
    head = re.split(r",(?![^\[]*\])", nodelist)[0]
    match = re.match(r"^(.*?)\[([^\]]+)\](.*)$", head)
    if not match:
        return head
    prefix, ranges, suffix = match.groups()
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def detect_launch_env() -> LaunchEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            launcher=env.get("MEGATRON_RL_LAUNCHER", "torchrun"),
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        # One task per GPU under srun (no torchrun inside the allocation).
        job = int(env.get("SLURM_JOB_ID", "0"))
        return LaunchEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            master_port=int(env.get("MASTER_PORT", 20000 + job % 20000)),
            launcher="slurm",
        )
    # One process, no launcher: an in-memory store, so no TCP port is picked (two single-process
    # jobs started at once could pick the same free port and one would fail with EADDRINUSE).
    return LaunchEnv(0, 1, 0, "127.0.0.1", 0, SINGLE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
