"""DAPO dynamic sampling: keep only prompts whose samples disagree, and sample more until the batch is full.

A group whose ``rollout.n`` rewards are all equal has zero group-relative advantage: it costs a
forward and backward pass and teaches nothing (with GRPO it only dilutes the loss denominator).
With ``algorithm.dynamic_sampling`` the trainer draws a prompt batch, generates and scores it,
keeps the groups whose rewards are not all equal, and repeats with the next prompt batch until
``trainer.prompts_per_step`` groups are kept or ``algorithm.dynamic_sampling_max_rounds`` rounds
were drawn.  The kept groups beyond the batch size are discarded; if the bound is hit first, the
batch is filled up with dropped groups (most recent first), so every step trains on exactly
``prompts_per_step x rollout.n`` samples and a step always terminates.

The decision reads the reward function's scores before any shaping (DAPO filters on accuracy:
a group of all-correct or all-wrong answers is dropped even if the overlong penalty varies), the
kept groups train on their shaped scores.

Every rank sees the same scores (rewards are shared) and so takes the same decisions; the
collectives of the extra rounds stay aligned without any extra communication.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from megatron_rl.trainer.experience import Samples

# draw(round) -> (samples of a fresh prompt batch, their training scores [B], the raw scores [B] that decide)
Draw = Callable[[int], "tuple[Samples, torch.Tensor, torch.Tensor]"]


def informative(scores: torch.Tensor, rows: list[int]) -> bool:
    """True when the group's rewards are not all equal (a singleton never is informative)."""
    group = scores[rows]
    return bool(group.max() != group.min())


@dataclasses.dataclass
class _Group:
    samples: Samples
    rows: list[int]
    scores: torch.Tensor  # training scores of the whole round


@dataclasses.dataclass
class FilledBatch:
    samples: Samples
    scores: torch.Tensor
    drawn_scores: torch.Tensor  # raw scores of every sample drawn this step (an unbiased reward curve)
    metrics: dict


def fill_batch(draw: Draw, groups_wanted: int, max_rounds: int) -> FilledBatch:
    """Draw rounds until ``groups_wanted`` informative groups are kept or ``max_rounds`` were drawn.

    Returns exactly ``groups_wanted`` groups (as long as each round yields at least that many
    groups, which a full prompt batch does), renumbered ``prompt_index = 0 .. groups_wanted - 1``
    in the order they were kept.  Metrics: ``dynamic_sampling/rounds`` (generation rounds drawn),
    ``prompts_drawn``, ``kept_groups`` (informative groups found), ``dropped_groups``,
    ``padded_groups`` (dropped groups used to fill a batch the bound left short).
    """
    if groups_wanted < 1 or max_rounds < 1:
        raise ValueError(f"groups_wanted and max_rounds must be >= 1, got {groups_wanted}, {max_rounds}")
    kept: list[_Group] = []
    dropped: list[_Group] = []
    drawn: list[torch.Tensor] = []
    rounds = prompts = 0
    while len(kept) < groups_wanted and rounds < max_rounds:
        samples, scores, raw = draw(rounds)
        rounds += 1
        scores = torch.as_tensor(scores, dtype=torch.float32)
        raw = torch.as_tensor(raw, dtype=torch.float32)
        drawn.append(raw)
        for rows in samples.groups().values():
            prompts += 1
            (kept if informative(raw, rows) else dropped).append(_Group(samples, rows, scores))
    found = len(kept)
    padding = list(reversed(dropped))[: max(0, groups_wanted - found)]
    chosen = kept[:groups_wanted] + padding
    parts, part_scores = [], []
    for gi, group in enumerate(chosen):
        parts.append(group.samples.select(group.rows, prompt_index=[gi] * len(group.rows)))
        part_scores.append(group.scores[group.rows])
    merged = _concat(parts)
    metrics = {
        "dynamic_sampling/rounds": rounds,
        "dynamic_sampling/prompts_drawn": prompts,
        "dynamic_sampling/kept_groups": found,
        "dynamic_sampling/dropped_groups": len(dropped),
        "dynamic_sampling/padded_groups": len(padding),
    }
    return FilledBatch(merged, torch.cat(part_scores), torch.cat(drawn), metrics)


def _concat(parts: list[Samples]) -> Samples:
    fields = [f.name for f in dataclasses.fields(Samples)]
    return Samples(**{name: [x for part in parts for x in getattr(part, name)] for name in fields})
