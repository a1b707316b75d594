"""The rollout layout's sizes, megatron-free so the planner, resolution and the feature rules read
one type without importing the memory estimator."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """``rollout.layout``: the inference model's TP / PP / EP / expert-TP (``etp`` None = ``tp``);
    CP is 1 and the rest of the world are data-parallel replicas.  The one layout type of the
    planner, resolution, validation and the refit."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @classmethod
    def of_training(cls, train) -> "RolloutLayout":
        """The training layout's sizes (a ``PlanOption``, ``ParallelLayout`` or ``parallel``
        config): with one chunk per rank, the layout that shares its weights."""
        return cls(tp=train.tp, pp=train.pp, ep=train.ep, etp=train.etp)

    @classmethod
    def filled(cls, asked, train) -> "RolloutLayout":
        """``asked`` (``rollout.layout``, sizes may be None; or None) with each unset size the
        training layout's."""
        if asked is None:
            return cls.of_training(train)
        return cls(tp=asked.tp or train.tp, pp=asked.pp or train.pp, ep=asked.ep or train.ep,
                   etp=asked.etp or train.etp)

    def replicas(self, world: int) -> int:
        return world // (self.tp * self.pp)

    def name(self) -> str:
        out = f"tp{self.tp} pp{self.pp}"
        if self.ep > 1 or self.expert_tp != self.tp:
            out += f" ep{self.ep}" + (f" etp{self.etp}" if self.expert_tp != self.tp else "")
        return out

    def settings(self) -> dict:
        """As ``rollout.layout`` config values (``etp`` null when it equals ``tp``)."""
        etp = None if self.etp in (None, self.tp) else self.etp
        return {"rollout.layout": {"tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": etp}}


def expert_tp(layout) -> int:
    """A layout's expert-TP: its ``etp``, null meaning its ``tp``."""
    return getattr(layout, "etp", None) or layout.tp


def shares_training_weights(infer: RolloutLayout, train) -> bool:
    """Whether the engine can generate with the actor's own chunk (no second model, no copy): the
    same TP / PP / EP / expert-TP and one chunk per rank (``train``: a ``PlanOption``,
    ``ParallelLayout`` or ``parallel`` config).  CP needs no copy: each CP rank generates whole
    sequences with its (replicated) TP / PP shard."""
    same = (infer.tp, infer.pp, infer.ep, infer.expert_tp) == (train.tp, train.pp, train.ep, expert_tp(train))
    return same and not (getattr(train, "vpp", None) or 1) > 1
