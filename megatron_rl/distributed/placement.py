"""Which ranks of a job train and which only generate (``rollout.ranks``).

With ``rollout.ranks = G > 0`` the last ``G`` ranks of the job are generators: they hold the
inference model on ``rollout.layout`` and nothing else, and the first ``world - G`` ranks train.
The two sets are two torch.distributed worlds of their own (each with megatron's parallel groups
for its layout, so every collective of either side is one it already runs alone), joined through
the job's TCP store: messages and samples through the store (:mod:`megatron_rl.distributed.bridge`),
weights rank to rank through a gloo group of the whole job (:mod:`megatron_rl.distributed.cross_world`).
Megatron's ``parallel_state`` is per process, so a second world is the only way one job can
build two layouts over two disjoint rank sets without each side joining the other's groups.

Pure arithmetic: the launcher imports it to name ranks, before torch is imported.
"""

from __future__ import annotations

import dataclasses

TRAINER, GENERATOR = "trainer", "generator"


@dataclasses.dataclass(frozen=True)
class Placement:
    role: str          # TRAINER or GENERATOR
    rank: int          # rank in its role's world
    size: int          # ranks in its role's world
    global_rank: int
    trainers: int
    generators: int

    @property
    def separate(self) -> bool:
        """Whether generation runs on ranks of its own."""
        return self.generators > 0


def place(global_rank: int, world_size: int, generators: int) -> Placement:
    """This rank's role: the last ``generators`` ranks generate, the others train."""
    if not 0 <= generators < world_size:
        raise ValueError(f"rollout.ranks={generators} leaves no training rank in a world of {world_size}")
    trainers = world_size - generators
    if global_rank < trainers:
        return Placement(TRAINER, global_rank, trainers, global_rank, trainers, generators)
    return Placement(GENERATOR, global_rank - trainers, generators, global_rank, trainers, generators)


def training_world(world_size: int | None, generators: int) -> int | None:
    """Ranks that train in a job of ``world_size`` ranks (None: not known yet)."""
    if world_size is None:
        return None
    return world_size - generators


def rank_names(world_size: int, generators: int) -> dict[int, str]:
    """``global rank -> how a failure message names it`` for the generator ranks (trainers keep
    their plain rank, which is also their rank in the training world)."""
    trainers = world_size - generators
    return {trainers + r: f"generator rank {r}" for r in range(generators)} if 0 < generators < world_size else {}
