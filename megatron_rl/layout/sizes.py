"""A world's parallel sizes, megatron-free so the group builder, the planner, resolution and the
feature rules read one type without importing megatron-core or the memory estimator."""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.compat.megatron_fixes import default_batch_p2p_comm
from megatron_rl.config.schema import ParallelConfig
from megatron_rl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """A world's parallel sizes: the training layout (``dp`` derived from the world size), and the
    rollout layout the inference model generates on (:meth:`for_rollout`: CP 1, one chunk per rank,
    the rest of the world data-parallel replicas)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    cp_comm_type: str = "p2p"
    batch_p2p_comm: bool = True
    hierarchical_cp: tuple[int, ...] | None = None  # a2a+p2p: CP sizes per level, inner first
    ep: int = 1  # expert parallel (MoE): experts split over ep ranks of the DP x CP ranks
    etp: int | None = None  # expert tensor parallel; None = tp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_model_parallel_size(self) -> int:
        """Ranks one copy of the experts spans: etp x ep x pp (megatron's expert rank generator)."""
        return self.expert_tp * self.ep * self.pp

    @classmethod
    def for_rollout(cls, asked, train) -> "ParallelLayout":
        """``rollout.layout``: ``asked`` (its sizes may be None; or None) with each unset size the
        training layout's (``train``: a ``PlanOption``, ``ParallelLayout`` or ``parallel`` config).
        ``dp`` stays 1 until a world is known (:meth:`on_world`)."""
        if asked is None:
            return cls(tp=train.tp, pp=train.pp, ep=train.ep, etp=train.etp)
        return cls(tp=asked.tp or train.tp, pp=asked.pp or train.pp, ep=asked.ep or train.ep,
                   etp=asked.etp or train.etp)

    def replicas(self, world: int) -> int:
        """Model replicas ``world`` ranks hold: its data-parallel size there."""
        return world // self.model_parallel_size

    def on_world(self, world: int) -> "ParallelLayout":
        """This layout with ``dp`` the rest of ``world``."""
        return dataclasses.replace(self, dp=self.replicas(world))

    def name(self) -> str:
        """``tp2 pp1`` (and ``cp``, ``ep`` / ``etp`` where set): how the planner names a rollout layout."""
        out = f"tp{self.tp} pp{self.pp}" + (f" cp{self.cp}" if self.cp > 1 else "")
        if self.ep > 1 or self.expert_tp != self.tp:
            out += f" ep{self.ep}" + (f" etp{self.etp}" if self.expert_tp != self.tp else "")
        return out

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> "ParallelLayout":
        mp = parallel.tp * parallel.pp * parallel.cp
        batch = parallel.batch_p2p_comm
        if batch is None:
            batch = default_batch_p2p_comm(parallel.pp, parallel.vpp)
        hierarchical = hierarchical_cp_sizes(parallel)
        return cls(
            tp=parallel.tp,
            pp=parallel.pp,
            vpp=parallel.vpp if parallel.vpp and parallel.vpp > 1 else None,
            cp=parallel.cp,
            dp=max(world_size // mp, 1),
            sequence_parallel=parallel.sequence_parallel and parallel.tp > 1,
            cp_comm_type=parallel.cp_comm_type,
            batch_p2p_comm=batch,
            hierarchical_cp=hierarchical,
            ep=parallel.ep,
            etp=parallel.etp if parallel.etp and parallel.etp != parallel.tp else None,
        )


def hierarchical_cp_sizes(parallel: ParallelConfig) -> tuple[int, ...] | None:
    """The CP levels ``a2a+p2p`` needs (TransformerEngine takes ``[a2a group, p2p group]`` from
    megatron's hierarchical CP groups); None for every other ``cp_comm_type``."""
    sizes = parallel.hierarchical_context_parallel_sizes
    key = "parallel.hierarchical_context_parallel_sizes"
    if parallel.cp_comm_type != "a2a+p2p":
        if sizes:
            raise ConfigError(key, sizes, "only cp_comm_type=a2a+p2p uses hierarchical CP groups",
                              "set parallel.cp_comm_type=a2a+p2p, or leave this key null")
        return None
    if not sizes or len(sizes) < 2 or any(int(n) < 1 for n in sizes) or math.prod(int(n) for n in sizes) != parallel.cp:
        raise ConfigError(key, sizes,
                          f"cp_comm_type=a2a+p2p needs CP sizes per level whose product is cp={parallel.cp}",
                          f"give [a2a size, p2p size] with a2a x p2p = {parallel.cp}, "
                          f"e.g. [{parallel.cp // 2 or 1}, 2]")
    return tuple(int(n) for n in sizes)


def expert_tp(layout) -> int:
    """A layout's expert-TP: its ``etp``, null meaning its ``tp``."""
    return getattr(layout, "etp", None) or layout.tp


def shares_training_weights(infer: ParallelLayout, train) -> bool:
    """Whether the engine can generate with the actor's own chunk (no second model, no copy): the
    same TP / PP / EP / expert-TP and one chunk per rank (``train``: a ``PlanOption``,
    ``ParallelLayout`` or ``parallel`` config).  CP needs no copy: each CP rank generates whole
    sequences with its (replicated) TP / PP shard."""
    same = (infer.tp, infer.pp, infer.ep, infer.expert_tp) == (train.tp, train.pp, train.ep, expert_tp(train))
    return same and not (getattr(train, "vpp", None) or 1) > 1
