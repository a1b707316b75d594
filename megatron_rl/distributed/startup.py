"""The one start-up sequence every entry point runs once torch.distributed is up.

Training, the generator ranks, score, generate, convert, smoke and the test workers all need the
same three things before they build a model: megatron's groups for their layout (seeded), the
groups as a ``ProcessGroupCollection`` to hand down, and the device.  Building them here keeps the
order (groups, then RNG seeds, then device) the same everywhere.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_rl.config.schema import Config, DistributedConfig
from megatron_rl.distributed.runtime import (
    ParallelLayout,
    active_groups,
    active_layout,
    init_model_parallel,
    reseed,
    resolve_device,
)

DEFAULT_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Started:
    """What an entry point gets back: its layout, megatron's groups for it, and its device."""

    layout: ParallelLayout
    groups: object  # megatron.core.process_groups_config.ProcessGroupCollection
    device: torch.device


def start_layout(layout: ParallelLayout, seed: int, timeout_s: int = DEFAULT_TIMEOUT_S,
                 dist_cfg: DistributedConfig | None = None, reuse: bool = False) -> Started:
    """Build megatron's groups for ``layout`` and seed the RNGs with ``seed``.

    ``reuse``: keep the groups when ``layout`` is already the active one and only reseed (a test
    worker switching layouts; rebuilding is the slow part)."""
    if reuse and layout == active_layout():
        reseed(seed)
        groups = active_groups()
    else:
        groups = init_model_parallel(layout, seed=seed, timeout_s=timeout_s)
    return Started(layout, groups, resolve_device(dist_cfg))


def start_model_parallel(cfg: Config, layout: ParallelLayout | None = None) -> Started:
    """:func:`start_layout` for a run's config; ``layout`` defaults to ``cfg.parallel`` on this world."""
    if layout is None:
        layout = ParallelLayout.from_config(cfg.parallel, dist.get_world_size())
    return start_layout(layout, cfg.run.seed, cfg.distributed.timeout_s, cfg.distributed)
