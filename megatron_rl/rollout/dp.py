"""Rollout over the data- and context-parallel ranks: each generator samples a distinct share of
the prompts, then every rank receives the whole batch.

A *generator* is one replica of the actor's tensor/pipeline shards: the TP x PP ranks that share
a data-parallel and a context-parallel index.  Context-parallel ranks hold the same shards as
their DP replica (CP splits sequences, not weights), and generation has no use for splitting a
sequence, so each CP rank is a generator of its own: DP x CP generators in all, none repeating
another's work.  The TP/PP ranks of one generator call the engine together with the same share
(megatron's engine splits the model between them).  The first rank of each generator (TP and PP rank
0) reports its samples, so the gathered batch holds each sample once, in prompt order.
"""

from __future__ import annotations

from typing import Optional

from megatron_rl.distributed import collectives
from megatron_rl.distributed.runtime import active_groups
from megatron_rl.rollout.engine import RolloutBatch, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.utils.seeds import derive_seed

# Per-sample fields a generator may return besides tokens and log-probs (None when it does not).
OPTIONAL_FIELDS = ("token_versions", "response_mask", "env_info")


def data_parallel_share(num_prompts: int, generators: int, index: int) -> range:
    """The prompt positions generator ``index`` samples: a contiguous ``ceil(num / generators)`` share."""
    per_rank = -(-num_prompts // generators)
    return range(index * per_rank, min(num_prompts, (index + 1) * per_rank))


def generator_of_groups(groups) -> tuple[int, int, bool]:
    """``(generators, generator, reports)`` on a layout of megatron's process groups ``groups`` (a
    ``pg_collection`` with CP 1): its data-parallel replicas are the generators, and the first rank
    of each (TP and PP rank 0) reports."""
    return groups.dp.size(), groups.dp.rank(), groups.tp.rank() == 0 and groups.pp.rank() == 0


def generator_of_this_rank(engine: RolloutEngine | None = None) -> tuple[int, int, bool]:
    """``(generators, this rank's generator, whether this rank reports that generator's samples)``.

    Generators are indexed by the DP x CP rank; with CP = 1 that is the data-parallel rank.  An
    engine generating on a layout of its own (``rollout.layout``) says which they are there."""
    if engine is not None and (found := engine.generator_of_this_rank()) is not None:
        return found
    groups = active_groups()
    return groups.dp_cp.size(), groups.dp_cp.rank(), groups.tp.rank() == 0 and groups.pp.rank() == 0


def generate_data_parallel(engine: RolloutEngine, prompt_ids: list[list[int]], params: SamplingParams,
                           seed: int, records: Optional[list[dict]] = None) -> RolloutBatch:
    """``params.n`` samples of every prompt, the same batch on every rank.

    ``prompt_index`` of the result indexes ``prompt_ids``; sample ``j`` of prompt ``i`` is at
    ``i * n + j``.  Each generator samples with its own seed derived from ``seed``.  ``records``
    (multi-turn: what each prompt's environments start from) go with their prompts.
    """
    generators, index, reports = generator_of_this_rank(engine)
    share = data_parallel_share(len(prompt_ids), generators, index)
    # The tag keeps the name it had when generators were the DP ranks: runs without CP sample
    # what they sampled before.
    extra = {} if records is None else {"records": [records[i] for i in share]}
    local = engine.generate([prompt_ids[i] for i in share], params, seed=derive_seed(seed, "dp_rank", index), **extra)
    optional = [(name, getattr(local, name)) for name in OPTIONAL_FIELDS]
    rows = [(share[local.prompt_index[k]], k, local.prompt_ids[k], local.response_ids[k],
             local.response_logprobs[k], local.finish_reason[k],
             tuple(values[k] if values is not None else None for _, values in optional))
            for k in range(len(local))] if reports else []
    gathered = collectives.all_gather_object(rows)
    merged = sorted((row for rank_rows in gathered for row in rank_rows), key=lambda r: r[:2])
    return RolloutBatch(
        prompt_index=[r[0] for r in merged], prompt_ids=[list(r[2]) for r in merged],
        response_ids=[list(r[3]) for r in merged], response_logprobs=[list(r[4]) for r in merged],
        finish_reason=[r[5] for r in merged], routing=_gathered_routing(local, share, merged),
        **{name: [r[6][f] for r in merged] if values is not None else None
           for f, (name, values) in enumerate(optional)},
    )


def _gathered_routing(local: RolloutBatch, share: range, merged: list) -> list | None:
    """The MoE routing the engine recorded, per sample of the gathered batch, for this rank's
    pipeline stage (each stage's TP x DP x CP ranks exchange theirs); None when not recorded."""
    if local.routing is None:
        return None
    recorded = dict(enumerate(local.routing))
    from megatron_rl.models.moe import gather_rollout_routing

    position = {row[:2]: k for k, row in enumerate(merged)}
    sample_index = {k: position[(share[local.prompt_index[k]], k)] for k in range(len(local))}
    reports = active_groups().tp.rank() == 0
    by_sample = gather_rollout_routing(recorded, sample_index, reports)
    return [by_sample.get(k) for k in range(len(merged))]
