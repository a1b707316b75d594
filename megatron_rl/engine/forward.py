"""Run a list of sequences through the model on any layout and get per-sequence outputs back.

This is the one data path for scoring, the reference/old log-prob passes and training:

1. sequences are split over data-parallel ranks (balanced by cost);
2. each rank plans its micro-batches (fixed size or token budget, same count on every DP rank);
3. each micro-batch is padded / packed and cut to this rank's context-parallel shard on the
   host (:mod:`megatron_rl.data.microbatch`), and only that shard moves to the device;
4. megatron's pipeline schedule runs forward (and backward when training) over the micro-batches;
5. the head's per-token outputs are gathered over CP as ``[T]`` vectors, over DP, and broadcast
   from the last pipeline stage, so every rank gets every sequence's outputs in the original order.

When training, each micro-batch's loss is already divided by the denominator of the whole
mini-batch.  With ``calculate_per_token_loss`` megatron sums (not averages) over micro-batches and
DP x CP ranks, and the count 0 returned with every loss
(:func:`megatron_rl.compat.megatron_fixes.pre_normalised_count`) keeps ``finalize_model_grads``
from dividing again: the gradients are those of the mini-batch loss, however the batch was cut.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.compat.megatron_fixes import pre_normalised_count
from megatron_rl.data.batching import plan_microbatches, split_data_parallel
from megatron_rl.data.microbatch import Microbatch, alignment, build_microbatch
from megatron_rl.distributed import collectives
from megatron_rl.engine.pipeline import run_microbatches
from megatron_rl.models.canonical import unwrap

# loss_fn(outputs, tensors, microbatch) -> (loss, logs): the loss already divided by the
# denominator of the whole mini-batch (trainer/update.py), so that megatron's sum of the
# gradients over micro-batches and DP x CP ranks is the gradient of the mini-batch loss.
LossFn = Callable[[dict, dict, Microbatch], tuple]


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    max_tokens_per_rank: Optional[int] = None
    micro_batch_size: int = 1
    packed: bool = True
    pad_id: int = 0


def _model_inputs(mb: Microbatch, device):
    return mb.to(device, ["tokens", "position_ids"]), mb.packed_seq_params(device)


def run_sequences(
    chunks: list,
    seqs: Sequence[dict],
    head: Callable,
    plan: BatchPlan,
    device: torch.device,
    *,
    loss_fn: Optional[LossFn] = None,
    forward_only: bool = True,
    stats: Optional[dict] = None,
) -> tuple[list[dict], list]:
    """Returns (per-sequence outputs on every rank, what ``loss_fn`` logged on this rank)."""
    tp = ps.get_tensor_model_parallel_world_size()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    sp = unwrap(chunks[0]).config.sequence_parallel
    align = alignment(cp, tp, sp)
    lengths = [int(s["tokens"].numel()) for s in seqs]
    mine = split_data_parallel(lengths, dp, dp_rank)
    groups = plan_microbatches(
        lengths, mine, max_tokens_per_rank=plan.max_tokens_per_rank, micro_batch_size=plan.micro_batch_size,
        cp=cp, align=align, packed=plan.packed, dp_group=ps.get_data_parallel_group(),
        multiple_of=ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1,
    )
    mbs = [build_microbatch([seqs[i] for i in g], g, cp_size=cp, cp_rank=cp_rank, align=align,
                            packed=plan.packed, pad_id=plan.pad_id) for g in groups]
    if stats is not None:
        stats["local_tokens"] = [mb.local_tokens for mb in mbs]
        stats["num_microbatches"] = len(mbs)
    collected: list[tuple[Microbatch, dict]] = []

    def forward_step(mb: Microbatch, model):
        inputs, packed_params = _model_inputs(mb, device)
        hidden = model(inputs["tokens"], inputs["position_ids"], None, packed_seq_params=packed_params)

        def loss_func(output):
            tensors = mb.to(device, [n for n in mb.tensors if n not in ("tokens", "position_ids")])
            outs = head(unwrap(model), output, tensors)
            collected.append((mb, {k: v.detach() for k, v in outs.items()}))
            if loss_fn is None:
                return output.sum() * 0.0, pre_normalised_count(), {}
            loss, logs = loss_fn(outs, tensors, mb)
            return loss, pre_normalised_count(), logs

        return hidden, loss_func

    longest = max((mb.tensors["tokens"].shape[-1] for mb in mbs), default=1)
    logs = run_microbatches(chunks, mbs, forward_step, forward_only=forward_only, seq_length=longest,
                            micro_batch_size=max((mb.tensors["tokens"].shape[0] for mb in mbs), default=1))
    return _collect(collected, len(seqs), head.outputs), logs


def _collect(collected, num_seqs: int, names) -> list[dict]:
    """Per-sequence outputs from the last stage's CP/DP shards onto every rank."""
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    mine: dict[int, dict] = {}
    if last_stage:
        cp_group = ps.get_context_parallel_group()
        for mb, outs in collected:
            per_name = {n: mb.gather_sequences(outs[n], cp_group) for n in names if n in outs}
            for j, idx in enumerate(mb.seq_indices):
                mine[idx] = {n: vecs[j] for n, vecs in per_name.items()}
        if ps.get_data_parallel_world_size() > 1:
            for part in collectives.all_gather_object(mine, group=ps.get_data_parallel_group()):
                mine.update(part)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        src = dist.get_global_rank(ps.get_pipeline_model_parallel_group(),
                                   ps.get_pipeline_model_parallel_world_size() - 1)
        mine = collectives.broadcast_object(mine if last_stage else None, src,
                                            group=ps.get_pipeline_model_parallel_group())
    missing = [i for i in range(num_seqs) if i not in mine]
    if missing:
        raise RuntimeError(f"no outputs for sequences {missing[:5]}")
    return [mine[i] for i in range(num_seqs)]
