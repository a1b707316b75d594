"""Process groups: torch.distributed (NCCL on GPU, gloo on CPU) and Megatron's parallel_state.

``init_distributed`` starts the world once per process; ``init_model_parallel`` (re)builds
Megatron's TP/PP/VPP/CP/DP groups for a layout and may be called again with another layout (the
test harness reuses worker processes that way).
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from megatron_rl.compat import cuda_available, enable_compat
from megatron_rl.config.schema import DistributedConfig, ParallelConfig
from megatron_rl.distributed.env import LaunchEnv, detect_launch_env


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """A resolved parallel layout; ``dp`` is derived from the world size."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    cp_comm_type: str = "p2p"
    batch_p2p_comm: bool = True

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> "ParallelLayout":
        mp = parallel.tp * parallel.pp * parallel.cp
        batch = parallel.batch_p2p_comm
        if batch is None:
            # megatron-core 0.16 gives wrong results for PP=2 + VPP with batched p2p.
            batch = not (parallel.vpp and parallel.pp == 2)
        return cls(
            tp=parallel.tp,
            pp=parallel.pp,
            vpp=parallel.vpp if parallel.vpp and parallel.vpp > 1 else None,
            cp=parallel.cp,
            dp=max(world_size // mp, 1),
            sequence_parallel=parallel.sequence_parallel and parallel.tp > 1,
            cp_comm_type=parallel.cp_comm_type,
            batch_p2p_comm=batch,
        )


def resolve_device(dist_cfg: DistributedConfig | None = None) -> torch.device:
    want = dist_cfg.device if dist_cfg else "auto"
    if want == "cpu" or (want == "auto" and not cuda_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(dist_cfg: DistributedConfig, launch: LaunchEnv | None = None) -> LaunchEnv:
    """Start torch.distributed for this process (idempotent)."""
    enable_compat()
    launch = launch or detect_launch_env()
    device = resolve_device(dist_cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Several ranks share the CPU cores; more threads per rank only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, launch.world_size)))
    if dist.is_initialized():
        return launch
    backend = dist_cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=dist_cfg.timeout_s),
    )
    return launch


def _destroy_groups() -> None:
    """Destroy every process group megatron's parallel_state created (frees gloo sockets)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.compat.megatron_fixes import release_group_caches

    release_group_caches()
    seen = set()
    for name, value in list(vars(ps).items()):
        if not name.startswith("_") or name.startswith("__"):
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        for group in values:
            if isinstance(group, dist.ProcessGroup) and id(group) not in seen and group != dist.group.WORLD:
                seen.add(id(group))
                try:
                    dist.destroy_process_group(group)
                except Exception:  # already destroyed or not a member
                    pass
    ps.destroy_model_parallel()


_CURRENT: ParallelLayout | None = None


def active_layout() -> ParallelLayout | None:
    """The layout megatron's groups were last built for in this process (None before any)."""
    return _CURRENT


def init_model_parallel(layout: ParallelLayout, seed: int = 1234, timeout_s: int = 600) -> None:
    """Build megatron's parallel groups for ``layout`` (tearing down a previous layout)."""
    global _CURRENT
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        _destroy_groups()
        _CURRENT = None
    world = dist.get_world_size()
    if world % layout.model_parallel_size:
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp={layout.model_parallel_size}"
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        distributed_timeout_minutes=timeout_s / 60.0,
        create_gloo_process_groups=cuda_available(),
    )
    _CURRENT = layout
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)


def current_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
    )
