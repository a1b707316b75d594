"""Which sequences go to which data-parallel rank and into which micro-batch.

Work is balanced on a cost that counts attention's quadratic term, so a micro-batch of one 16k
sequence and a micro-batch of sixteen 1k sequences are not treated as equal.  With a token budget
(``batch.max_tokens_per_rank``) micro-batches are filled so that no rank holds more than the budget
of tokens; at context parallelism ``cp`` a rank holds ``1/cp`` of each sequence, so sequences up to
``budget * cp`` tokens fit.  Every data-parallel rank runs the same number of micro-batches.

Unless a config fixes ``batch.max_tokens_per_rank`` or ``batch.micro_batch_size``, the budget is
derived (:func:`default_token_budget`): room for :data:`DEFAULT_SEQUENCES_PER_MICROBATCH` sequences
of the longest length the config allows, capped by what :data:`DEFAULT_ACTIVATION_BUDGET_BYTES` of
activations hold, never below one such sequence.
"""

from __future__ import annotations

import heapq
from typing import Optional, Sequence

from megatron_rl.data.microbatch import align_to
from megatron_rl.distributed import collectives
from megatron_rl.errors import DataError

# The derived token budget: this many full-length sequences per micro-batch ...
DEFAULT_SEQUENCES_PER_MICROBATCH = 64
# ... unless their activations (kept for backward, per rank) would exceed this.
DEFAULT_ACTIVATION_BUDGET_BYTES = 4 * 2**30


def default_token_budget(max_seq_len: int, activation_bytes_per_token: float, *, cp: int = 1, align: int = 1) -> int:
    """Tokens per rank per micro-batch when the config sets neither a budget nor a micro-batch size.

    ``min(64 x one full-length sequence, 4 GiB / activation bytes per token)``, and at least one
    full-length sequence (``max_seq_len`` aligned, ``1/cp`` of it per rank), which always fits."""
    longest = align_to(max_seq_len, align) // cp
    cap = int(DEFAULT_ACTIVATION_BUDGET_BYTES // max(activation_bytes_per_token, 1e-9))
    return max(longest, min(DEFAULT_SEQUENCES_PER_MICROBATCH * longest, cap))


def sequence_cost(length: int, attention_weight: float = 1.0 / 4096) -> float:
    """Linear work (MLP, projections) plus a quadratic attention term, in token units."""
    return length + attention_weight * length * length


def lpt_partition(costs: Sequence[float], bins: int) -> list[list[int]]:
    """Longest-processing-time-first: biggest item to the lightest bin.  Deterministic."""
    if bins <= 0:
        raise ValueError("need at least one bin")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (load + costs[i], b))
    return [sorted(bin_) for bin_ in out]


def split_data_parallel(lengths: Sequence[int], dp_size: int, dp_rank: int) -> list[int]:
    """Indices of the sequences this data-parallel rank processes (balanced by cost)."""
    if len(lengths) < dp_size:
        raise DataError(
            "batch", len(lengths),
            f"a batch of {len(lengths)} sequences cannot be split over {dp_size} data-parallel ranks",
            "use at least as many sequences per step as data-parallel ranks",
        )
    if dp_size == 1:
        return list(range(len(lengths)))
    return lpt_partition([sequence_cost(n) for n in lengths], dp_size)[dp_rank]


def _local_tokens(lengths: Sequence[int], members: Sequence[int], align: int, cp: int, packed: bool) -> int:
    if not members:
        return 0
    if packed:
        return sum(align_to(lengths[i], align) for i in members) // cp
    return align_to(max(lengths[i] for i in members), align) * len(members) // cp


def plan_microbatches(
    lengths: Sequence[int],
    indices: Sequence[int],
    *,
    max_tokens_per_rank: Optional[int],
    micro_batch_size: int,
    cp: int,
    align: int,
    packed: bool,
    dp_group=None,
    multiple_of: int = 1,
    min_count: int = 1,
    oversized_alone: bool = False,
) -> list[list[int]]:
    """Group ``indices`` (this rank's sequences) into micro-batches.

    Without a token budget: ``ceil(n / micro_batch_size)`` balanced groups.  With one: the fewest
    micro-batches (at least ``min_count``) whose local token count stays within the budget; a
    sequence over the budget is an error, or with ``oversized_alone`` (a derived budget, which
    a warm-up answer longer than the response limit may exceed) a micro-batch of its own.  The
    count is agreed (max) over the data-parallel group and rounded up to ``multiple_of`` (the
    interleaved pipeline schedule needs a multiple of the pipeline size).
    """
    indices = list(indices)
    if not indices:
        return []
    if max_tokens_per_rank:
        for i in indices:
            local = _local_tokens(lengths, [i], align, cp, packed)
            if local > max_tokens_per_rank and not oversized_alone:
                raise DataError(
                    "batch.max_tokens_per_rank", max_tokens_per_rank,
                    f"a sequence of {lengths[i]} tokens needs {local} tokens per rank at cp={cp}, over the budget",
                    f"raise batch.max_tokens_per_rank to >= {local}, raise parallel.cp, or cap the response length",
                )
        total = _local_tokens(lengths, indices, align, cp, packed=True)
        count = max(1, min_count, -(-total // max_tokens_per_rank))
        while count < len(indices) and not _fits(lengths, _balanced(lengths, indices, count), align, cp,
                                                packed, max_tokens_per_rank):
            count += 1
    else:
        count = max(min_count, -(-len(indices) // (micro_batch_size or 1)))
    count = _agree_max(count, dp_group)
    if multiple_of > 1:
        count = -(-count // multiple_of) * multiple_of
        if count > len(indices):
            raise DataError(
                "batch", len(indices),
                f"the interleaved pipeline schedule needs {count} micro-batches here (a multiple of the "
                f"pipeline size {multiple_of}, at least {min_count}), but a data-parallel rank has only "
                f"{len(indices)} sequences",
                f"use at least {count} sequences per data-parallel rank per pass "
                "(trainer.prompts_per_step x rollout.n / data-parallel size / algorithm.mini_batches), "
                "or parallel.vpp=null",
            )
    count = min(count, len(indices))
    if max_tokens_per_rank:
        return _balanced(lengths, indices, count)
    return [sorted(b) for b in _even_chunks(indices, count)]


def _fits(lengths, bins, align, cp, packed, budget) -> bool:
    """Every micro-batch within the budget (one sequence alone always fits: it was checked before)."""
    return all(len(b) == 1 or _local_tokens(lengths, b, align, cp, packed) <= budget for b in bins)


def _balanced(lengths, indices, count: int) -> list[list[int]]:
    count = min(count, len(indices))
    parts = lpt_partition([sequence_cost(lengths[i]) for i in indices], count)
    return [[indices[j] for j in part] for part in parts if part]


def _even_chunks(items: list, count: int) -> list[list]:
    count = min(count, len(items))
    base, extra = divmod(len(items), count)
    out, start = [], 0
    for c in range(count):
        size = base + (1 if c < extra else 0)
        out.append(items[start : start + size])
        start += size
    return out


def _agree_max(count: int, group) -> int:
    if group is None:
        return count
    return collectives.agree_max(count, group)
