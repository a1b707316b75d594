"""Process groups: torch.distributed (NCCL on GPU, gloo on CPU) and Megatron's parallel_state.

``init_distributed`` starts the world once per process; ``init_model_parallel`` (re)builds
Megatron's TP/PP/VPP/CP/DP groups for a layout, returns them as a ``ProcessGroupCollection``, and
may be called again with another layout (the test harness reuses worker processes that way).
Entry points start through :mod:`megatron_rl.distributed.startup`.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os

import torch
import torch.distributed as dist

from megatron_rl.capabilities import BACKENDS, DEVICES
from megatron_rl.compat import cuda_available, enable_compat
from megatron_rl.compat.parallel_state import destroy_model_parallel_groups
from megatron_rl.config.schema import DistributedConfig
from megatron_rl.distributed.env import PORT_FILE_ENV, SINGLE, LaunchEnv, detect_launch_env
from megatron_rl.distributed.placement import Placement, place
from megatron_rl.distributed.rendezvous import published_store
from megatron_rl.errors import ConfigError
from megatron_rl.layout.sizes import ParallelLayout

AUTO, CUDA, CPU = DEVICES
_, NCCL, GLOO = BACKENDS  # the first is AUTO again


def resolve_device(dist_cfg: DistributedConfig | None = None) -> torch.device:
    """``distributed.device`` resolved: ``auto`` is CUDA when this machine has it."""
    want = dist_cfg.device if dist_cfg else AUTO
    if want not in DEVICES:
        raise ConfigError("distributed.device", want, "unknown device", f"use one of {', '.join(DEVICES)}")
    if want == CPU or (want == AUTO and not cuda_available()):
        return torch.device(CPU)
    return torch.device(CUDA, int(os.environ.get("LOCAL_RANK", 0)))


def resolve_backend(dist_cfg: DistributedConfig, device: torch.device) -> str:
    """``distributed.backend`` resolved: ``auto`` is NCCL on CUDA, gloo on the CPU."""
    if dist_cfg.backend not in BACKENDS:
        raise ConfigError("distributed.backend", dist_cfg.backend, "unknown backend",
                          f"use one of {', '.join(BACKENDS)}")
    if dist_cfg.backend != AUTO:
        return dist_cfg.backend
    return NCCL if device.type == CUDA else GLOO


def init_distributed(dist_cfg: DistributedConfig, launch: LaunchEnv | None = None, generators: int = 0) -> Placement:
    """Start torch.distributed for this process (idempotent) and say where it sits.

    ``generators > 0`` (``rollout.ranks``): the last ``generators`` ranks form a world of their
    own, the others the training world, both on the job's one TCP store under prefixes of their
    own (:mod:`megatron_rl.distributed.placement`); :func:`job_store` is that store."""
    global _JOB_STORE, _PLACEMENT
    enable_compat()
    launch = launch or detect_launch_env()
    where = place(launch.rank, launch.world_size, generators)
    _PLACEMENT = where
    device = resolve_device(dist_cfg)
    if device.type == CUDA:
        torch.cuda.set_device(device)
    else:
        # Several ranks share the CPU cores; more threads per rank only contend.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, launch.world_size)))
    if dist.is_initialized():
        return where
    timeout = datetime.timedelta(seconds=dist_cfg.timeout_s)
    port_file = os.environ.get(PORT_FILE_ENV)
    if launch.launcher == SINGLE:
        init = {"store": dist.HashStore()}
    elif port_file and launch.master_port == 0:  # ranks of the local launcher or the test harness
        _JOB_STORE = published_store(launch.master_addr, launch.rank, port_file, timeout)
        init = {"store": dist.PrefixStore(where.role, _JOB_STORE) if where.separate else _JOB_STORE}
    elif where.separate:
        # Under torchrun the agent already serves a store at MASTER_PORT (as torch's env:// init does,
        # every worker is then a client); else rank 0 serves it.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        serves = launch.rank == 0 and not agent_store
        _JOB_STORE = dist.TCPStore(launch.master_addr, launch.master_port, is_master=serves, timeout=timeout,
                                   wait_for_workers=False, multi_tenant=True)
        init = {"store": dist.PrefixStore(where.role, _JOB_STORE)}
    else:
        init = {"init_method": f"tcp://{launch.master_addr}:{launch.master_port}"}
    dist.init_process_group(backend=resolve_backend(dist_cfg, device), rank=where.rank, world_size=where.size,
                            timeout=timeout, **init)
    return where


def shutdown_distributed() -> None:
    """Destroy megatron's process groups and the default one, if this process started them.

    A process that returns to the interpreter (one rank, no launcher) must not leave gloo groups
    alive: their threads race the interpreter's teardown, and the process can abort after its last
    line with "terminate called without an active exception".  Launched ranks leave with
    ``os._exit`` (:mod:`megatron_rl.distributed.guard`) and need none of this."""
    global _CURRENT, _GROUPS, _PLACEMENT
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        destroy_model_parallel_groups()
    _CURRENT = _GROUPS = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _PLACEMENT = None


_JOB_STORE = None
_PLACEMENT: Placement | None = None


def job_store():
    """The TCP store every rank of a job with generator ranks of their own shares (None otherwise)."""
    return _JOB_STORE


def job_placement() -> Placement | None:
    """Where this process sits in its job (None before :func:`init_distributed`)."""
    return _PLACEMENT


_CURRENT: ParallelLayout | None = None
_GROUPS = None  # the ProcessGroupCollection of _CURRENT


def active_layout() -> ParallelLayout | None:
    """The layout megatron's groups were last built for in this process (None before any)."""
    return _CURRENT


def active_groups():
    """The ``ProcessGroupCollection`` of :func:`active_layout` (None before any layout is built).

    For code below the entry points that has no collection handed to it; entry points keep the one
    :func:`init_model_parallel` returns."""
    return _GROUPS


_OVERRIDE = None  # (layout, groups) while a model of another layout runs (layout_active)


@contextlib.contextmanager
def layout_active(layout: ParallelLayout, groups):
    """Within the block, :func:`active_layout` and :func:`active_groups` are ``layout`` and its
    ``groups`` (from :func:`own_layout_groups`): a model built on a layout of its own beside the
    training one (a distillation teacher) is built, loaded and run by the same code as the actor."""
    global _CURRENT, _GROUPS, _OVERRIDE
    saved = _CURRENT, _GROUPS, _OVERRIDE
    _CURRENT, _GROUPS, _OVERRIDE = layout, groups, (layout, groups)
    try:
        yield groups
    finally:
        _CURRENT, _GROUPS, _OVERRIDE = saved


def overriding_groups():
    """The groups :func:`layout_active` put in place (None on the layout megatron's parallel_state
    holds): megatron's pipeline schedules read parallel_state unless handed other groups."""
    return _OVERRIDE[1] if _OVERRIDE else None


@functools.lru_cache(maxsize=None)
def own_layout_groups(tp: int, pp: int, cp: int, world: int):
    """megatron's groups (TP, CP, DP, PP, embeddings) for a dense model on a layout of its own beside
    the training one, on all ``world`` ranks; collective: every rank builds them, once per process
    and layout."""
    from megatron.core.inference.shards import build_inference_pg_collection

    return build_inference_pg_collection(world_size=world, tp_size=tp, pp_size=pp, cp_size=cp, ep_size=1,
                                         expt_tp_size=1)


def init_model_parallel(layout: ParallelLayout, seed: int = 1234, timeout_s: int = 600):
    """Build megatron's parallel groups for ``layout`` (tearing down a previous layout); returns
    them as a ``megatron.core.process_groups_config.ProcessGroupCollection``."""
    global _CURRENT, _GROUPS
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    if ps.model_parallel_is_initialized():
        destroy_model_parallel_groups()
        _CURRENT = _GROUPS = None
    world = dist.get_world_size()
    if world % layout.model_parallel_size:
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp={layout.model_parallel_size}"
        )
    if world % layout.expert_model_parallel_size:
        raise ValueError(f"world size {world} is not divisible by etp*ep*pp={layout.expert_model_parallel_size}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        hierarchical_context_parallel_sizes=list(layout.hierarchical_cp) if layout.hierarchical_cp else None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        distributed_timeout_minutes=timeout_s / 60.0,
        create_gloo_process_groups=cuda_available(),
    )
    _CURRENT = layout
    _GROUPS = ProcessGroupCollection.use_mpu_process_groups()
    reseed(seed)
    return _GROUPS


def layout_groups(tp: int, pp: int, ep: int, expert_tp: int, world: int):
    """megatron's groups for a layout beside the active one (an inference model on
    ``rollout.layout``), as a ``ProcessGroupCollection``; collective: every rank of the world
    creates them, once per process and layout."""
    from megatron.core.inference.shards import build_inference_pg_collection

    return build_inference_pg_collection(world_size=world, tp_size=tp, pp_size=pp, cp_size=1, ep_size=ep,
                                         expt_tp_size=expert_tp)


@functools.lru_cache(maxsize=None)
def one_rank_group():
    """A group of this rank alone (created collectively, once per process): it stands in for a
    model's CP group while that model generates whole sequences."""
    group, _ = dist.new_subgroups(group_size=1)
    return group


def reseed(seed: int) -> None:
    """Seed torch's and megatron's model-parallel RNGs as a fresh layout does."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)
