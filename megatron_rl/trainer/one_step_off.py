"""``trainer.mode=one_step_off``: each step trains on the batch generated one update earlier.

Step ``k`` starts from the weights of ``k - 1`` updates.  It generates the batch for step
``k + 1`` with them, then trains on the batch generated at step ``k - 1`` (with the weights of
``k - 2`` updates): every batch but the first is one policy version stale, as when generation of
the next batch overlaps the update on separate generators.  Here both run on the same ranks, one
after the other, so a step costs what a synchronous one does; what the mode gives is the
staleness and its correction (``algorithm.rollout_correction``, the recomputed old log-probs as
the proximal policy), tested and resumable.  The batches and their seeds are the synchronous
run's: batch ``k`` is drawn ``k``-th and sampled with the seed of step ``k``, so with frozen
weights the two modes train on the same samples.

The batch waiting for the next step is part of every checkpoint
(:mod:`megatron_rl.trainer.rollout_buffer`), so a resumed run trains on exactly what the
uninterrupted one would have; a run resumed in ``sync`` mode trains on it first, so no drawn
prompt is skipped.  The last step of a run generates nothing ahead; a run extended after it starts
its next step from a fresh batch.
"""

from __future__ import annotations

from typing import Callable

from megatron_rl.trainer.rollout_buffer import GeneratedBatch
from megatron_rl.trainer.staleness import StalenessPlan


def take_and_generate_ahead(buffer: dict[int, GeneratedBatch], step: int, version: int, plan: StalenessPlan,
                            steps: int, generate: Callable[[int, int], GeneratedBatch]) -> GeneratedBatch:
    """Batch ``step`` (from ``buffer``, else generated now), then into ``buffer`` every later batch
    the weights of ``version`` updates may generate (:meth:`StalenessPlan.last_batch`) and it
    lacks, in step order: ``generate(step, version)`` draws and samples the batch of ``step``."""
    current = buffer.pop(step, None) or generate(step, version)
    for ahead in range(step + 1, plan.last_batch(version, steps) + 1):
        if ahead not in buffer:
            buffer[ahead] = generate(ahead, version)
    return current
