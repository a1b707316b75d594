"""One candidate layout of the planner: a world's sizes (the one
:class:`~megatron_rl.layout.sizes.ParallelLayout` the trainer and the rollout run on) and the memory
switches the plan decides with them, with the config keys they set."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.layout.sizes import ParallelLayout
from megatron_rl.planner import moe

# The size fields :meth:`PlanOption.of` takes; the other keywords are the memory switches.
SIZE_FIELDS = ("tp", "pp", "cp", "dp", "sequence_parallel", "cp_comm_type", "hierarchical_cp", "ep", "etp")


def _size(name: str) -> property:
    """``sizes.<name>`` read under its own name, as the memory model reads a layout."""
    return property(lambda self: getattr(self.sizes, name), doc=f"``sizes.{name}``")


@dataclasses.dataclass(frozen=True)
class PlanOption:
    """``sizes``: TP / PP / CP / DP, sequence parallelism, the CP communication
    (``hierarchical_cp``: (a2a size, ring size); None = (2, cp / 2)) and the expert sizes."""

    sizes: ParallelLayout = ParallelLayout(sequence_parallel=True)
    recompute: Optional[str] = None  # None | "selective" | "full"
    offload: bool = False
    distributed_optimizer: bool = False
    rollout_layout: Optional[ParallelLayout] = None  # megatron's engine: rollout.layout as set; None = chosen
    generators: int = 0  # rollout.ranks: GPUs that only generate (on rollout.layout); the layout above trains

    tp = _size("tp")
    pp = _size("pp")
    cp = _size("cp")
    dp = _size("dp")
    sequence_parallel = _size("sequence_parallel")
    cp_comm_type = _size("cp_comm_type")
    hierarchical_cp = _size("hierarchical_cp")
    ep = _size("ep")
    etp = _size("etp")

    @classmethod
    def of(cls, **kw) -> "PlanOption":
        """An option from flat keywords (``tp=4, recompute="full"``); sequence parallelism is on
        unless ``sequence_parallel=False`` (the planner's default)."""
        sizes = {"sequence_parallel": True, **{k: kw.pop(k) for k in SIZE_FIELDS if k in kw}}
        return cls(sizes=ParallelLayout(**sizes), **kw)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def settings(self, with_critic: bool = True) -> dict:
        """The config keys this layout decides, with their values (``None`` = null): every
        memory switch, also when off, so a config can be checked against the plan."""
        out = {"parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.cp": self.cp,
               "parallel.sequence_parallel": self.sequence_parallel and self.tp > 1}
        if self.cp > 1:
            out["parallel.cp_comm_type"] = self.cp_comm_type
            if self.cp_comm_type == "a2a+p2p":
                out["parallel.hierarchical_context_parallel_sizes"] = list(cp_levels(self))
        out["model.recompute.granularity"] = self.recompute
        out["actor.optim.use_distributed_optimizer"] = self.distributed_optimizer
        if with_critic:
            out["critic.optim.use_distributed_optimizer"] = self.distributed_optimizer
        out["trainer.offload"] = self.offload
        out["rollout.engine"] = "megatron"
        if self.generators:
            out["rollout.ranks"] = self.generators
        out.update(moe.settings(self))
        return out

    def overrides(self, with_critic: bool = True) -> list[str]:
        """:meth:`settings` as command-line overrides; dense layouts leave out the expert sizes."""
        dense = self.ep == 1 and self.etp is None
        return [f"{key}={format_value(value)}" for key, value in self.settings(with_critic).items()
                if not (dense and key in moe.SETTINGS_KEYS)]


def format_value(value) -> str:
    """A config value as an override writes it: true/false, null, [a,b]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def cp_levels(layout: PlanOption) -> tuple[int, int]:
    """``(a2a size, ring size)`` of the CP group: ``(cp, 1)`` for a2a, ``(1, cp)`` for p2p and
    all_gather, the hierarchical sizes (default ``(2, cp / 2)``) for a2a+p2p."""
    if layout.cp_comm_type == "a2a":
        return layout.cp, 1
    if layout.cp_comm_type == "a2a+p2p":
        if layout.hierarchical_cp:
            return int(layout.hierarchical_cp[0]), int(layout.hierarchical_cp[1])
        return 2, max(layout.cp // 2, 1)
    return 1, layout.cp
