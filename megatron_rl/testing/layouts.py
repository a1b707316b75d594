"""Switch the parallel layout inside a test worker."""

from __future__ import annotations

import torch.distributed as dist

from megatron_rl.config.schema import ParallelConfig
from megatron_rl.distributed.startup import start_layout
from megatron_rl.layout.sizes import ParallelLayout


def use_layout(tp=1, pp=1, vpp=None, cp=1, sp=False, cp_comm_type="p2p", batch_p2p_comm=None,
               hierarchical_cp=None, seed=1234, ep=1, etp=None) -> ParallelLayout:
    """(Re)build megatron's groups for this layout on the pool's world; returns the ParallelLayout.

    ``hierarchical_cp`` is ``parallel.hierarchical_context_parallel_sizes`` (``a2a+p2p``: the a2a
    size first, e.g. ``[2, 2]`` at cp=4); ``ep`` / ``etp`` are ``parallel.ep`` / ``parallel.etp`` (MoE).

    Every call leaves the RNGs seeded with ``seed``, as a fresh ``init_model_parallel`` does; the
    groups are rebuilt only when the layout changes (that is the slow part)."""
    cfg = ParallelConfig(
        tp=tp, pp=pp, vpp=vpp, cp=cp, sequence_parallel=sp, cp_comm_type=cp_comm_type,
        batch_p2p_comm=batch_p2p_comm,
        hierarchical_context_parallel_sizes=list(hierarchical_cp) if hierarchical_cp else None, ep=ep, etp=etp,
    )
    return start_layout(ParallelLayout.from_config(cfg, dist.get_world_size()), seed, reuse=True).layout
