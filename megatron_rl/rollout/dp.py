"""Rollout over data-parallel ranks: each DP rank generates for its share of the prompts, then
every rank receives the whole batch.

The prompts are cut into contiguous shares in DP-rank order.  All ranks of one DP index (its
TP/PP/CP ranks) generate the same samples; the first rank of each DP index is the one whose
samples are kept, so the gathered batch holds each sample once, in prompt order.
"""

from __future__ import annotations

from megatron.core import parallel_state

from megatron_rl.distributed import collectives
from megatron_rl.rollout.engine import RolloutBatch, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.utils.seeds import derive_seed


def data_parallel_share(num_prompts: int, dp_size: int, dp_rank: int) -> range:
    """The prompt positions ``dp_rank`` generates for: a contiguous ``ceil(num / dp)`` share."""
    per_rank = -(-num_prompts // dp_size)
    return range(dp_rank * per_rank, min(num_prompts, (dp_rank + 1) * per_rank))


def generate_data_parallel(engine: RolloutEngine, prompt_ids: list[list[int]], params: SamplingParams,
                           seed: int) -> RolloutBatch:
    """``params.n`` samples of every prompt, the same batch on every rank.

    ``prompt_index`` of the result indexes ``prompt_ids``; sample ``j`` of prompt ``i`` is at
    ``i * n + j``.  Each DP rank samples with its own seed derived from ``seed``.
    """
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = data_parallel_share(len(prompt_ids), dp_size, dp_rank)
    local = engine.generate([prompt_ids[i] for i in share], params, seed=derive_seed(seed, "dp_rank", dp_rank))
    rows = [(share[local.prompt_index[k]], k, local.prompt_ids[k], local.response_ids[k],
             local.response_logprobs[k], local.finish_reason[k]) for k in range(len(local))]
    gathered = collectives.all_gather_object((dp_rank, rows))
    rows_of_dp_rank: dict[int, list] = {}
    for rank_dp, rank_rows in gathered:
        rows_of_dp_rank.setdefault(rank_dp, rank_rows)
    merged = sorted((row for rank_rows in rows_of_dp_rank.values() for row in rank_rows), key=lambda r: r[:2])
    return RolloutBatch(
        prompt_index=[r[0] for r in merged], prompt_ids=[list(r[2]) for r in merged],
        response_ids=[list(r[3]) for r in merged], response_logprobs=[list(r[4]) for r in merged],
        finish_reason=[r[5] for r in merged],
    )
