"""Run a list of sequences through the model on any layout and get per-sequence outputs back.

This is the one data path for scoring, the reference/old log-prob passes and training:

1. sequences are split over data-parallel ranks (balanced by cost);
2. each rank plans its micro-batches (token budget -- derived from the model and the longest
   sequence unless the config sets one -- or fixed size; the same count on every DP rank);
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
from megatron.core.pipeline_parallel.utils import is_pp_last_stage

from megatron_rl.compat.megatron_fixes import pre_normalised_count
from megatron_rl.data.batching import plan_microbatches, split_data_parallel
from megatron_rl.data.microbatch import Microbatch, alignment, build_microbatch
from megatron_rl.distributed import collectives
from megatron_rl.distributed.runtime import active_groups
from megatron_rl.engine.pipeline import run_microbatches
from megatron_rl.models.canonical import unwrap

# loss_fn(outputs, tensors, microbatch) -> (loss, logs): the loss already divided by the
# denominator of the whole mini-batch (trainer/update.py), so that megatron's sum of the
# gradients over micro-batches and DP x CP ranks is the gradient of the mini-batch loss.
LossFn = Callable[[dict, dict, Microbatch], tuple]


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How :func:`run_sequences` cuts sequences into micro-batches: a token budget per rank when
    ``max_tokens_per_rank`` is set, else ``micro_batch_size`` sequences.  ``derived`` marks a budget
    the config did not set (:func:`batch_plan`): a sequence over it gets a micro-batch of its own
    instead of an error, and there are at least ``min_microbatches`` (the pipeline size)."""

    max_tokens_per_rank: Optional[int] = None
    micro_batch_size: Optional[int] = 1
    packed: bool = True
    pad_id: int = 0
    derived: bool = False
    min_microbatches: int = 1

    def describe(self) -> str:
        if self.max_tokens_per_rank is None:
            return f"{self.micro_batch_size or 1} sequence(s) per micro-batch (batch.micro_batch_size)"
        origin = "derived" if self.derived else "batch.max_tokens_per_rank"
        return f"up to {self.max_tokens_per_rank} tokens per micro-batch per rank ({origin})"


def batch_plan(batch, layout, derived_budget: Optional[int], pad_id: int = 0) -> BatchPlan:
    """The plan for ``batch`` (a BatchConfig): ``max_tokens_per_rank`` when set, else
    ``micro_batch_size`` when set, else the resolved ``derived_budget``."""
    if derived_budget is None:
        return BatchPlan(batch.max_tokens_per_rank, batch.micro_batch_size, batch.packing, pad_id=pad_id)
    return BatchPlan(derived_budget, None, batch.packing, pad_id=pad_id, derived=True, min_microbatches=layout.pp)


def _model_inputs(mb: Microbatch, device):
    return mb.to(device, ["tokens", "position_ids"]), mb.packed_seq_params(device)


def interleaved_training_minimum(pp: int) -> int:
    """Micro-batches a forward+backward pass through virtual pipeline stages needs: ``2 * pp``.

    megatron-core 0.19.2's interleaved 1F1B schedule with exactly ``pp`` micro-batches (which it
    accepts) waits forever in its p2p exchange when it runs a backward pass; ``2 * pp`` and more
    work (measured for pp 2 and 4 on gloo, equal and unequal lengths).  Forward-only passes work
    with ``pp``."""
    return 2 * pp


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
    pgs = active_groups()
    tp = pgs.tp.size()
    cp, cp_rank = pgs.cp.size(), pgs.cp.rank()
    dp, dp_rank = pgs.dp.size(), pgs.dp.rank()
    sp = unwrap(chunks[0]).config.sequence_parallel
    align = alignment(cp, tp, sp)
    lengths = [int(s["tokens"].numel()) for s in seqs]
    mine = split_data_parallel(lengths, dp, dp_rank)
    pp, interleaved = pgs.pp.size(), len(chunks) > 1
    groups = plan_microbatches(
        lengths, mine, max_tokens_per_rank=plan.max_tokens_per_rank, micro_batch_size=plan.micro_batch_size,
        cp=cp, align=align, packed=plan.packed, dp_group=pgs.dp,
        multiple_of=pp if interleaved else 1,
        min_count=max(plan.min_microbatches,
                      interleaved_training_minimum(pp) if interleaved and not forward_only else 1),
        oversized_alone=plan.derived,
    )
    mbs = [build_microbatch([seqs[i] for i in g], g, cp_size=cp, cp_rank=cp_rank, align=align,
                            packed=plan.packed, pad_id=plan.pad_id) for g in groups]
    if stats is not None:
        stats["local_tokens"] = [mb.local_tokens for mb in mbs]
        stats["num_microbatches"] = len(mbs)
    collected: list[tuple[Microbatch, dict]] = []

    def forward_step(mb: Microbatch, model):
        inputs, packed_params = _model_inputs(mb, device)
        for hook in getattr(unwrap(model), "microbatch_hooks", ()):  # e.g. MoE routers (models/moe/router.py)
            hook(mb)
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


# How an output's dtype travels in :func:`_gather_outputs` (values go as float64: exact for these).
_OUTPUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _gather_outputs(mine: dict[int, dict], names, group) -> dict[int, dict]:
    """Every rank's per-sequence output vectors on every rank of ``group``, as two flat tensors
    per rank (a header of sequence index, then dtype and length per output name, and the
    values), not pickled tensors: once per step on every data-parallel rank, pickling cost more
    than the update itself on small models."""
    header, flat = [], []
    for idx, outs in mine.items():
        header.append(idx)
        for name in names:
            vec = outs.get(name)
            if vec is None:
                header += [-1, 0]
                continue
            header += [_OUTPUT_DTYPES.index(vec.dtype), vec.numel()]
            flat.append(vec.detach().reshape(-1).to("cpu", torch.float64))
    headers = collectives.all_gather_varlen(torch.tensor(header, dtype=torch.int64), group)
    values = collectives.all_gather_varlen(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64), group)
    out: dict[int, dict] = {}
    device = next((v.device for outs in mine.values() for v in outs.values()), torch.device("cpu"))
    per_seq = 1 + 2 * len(names)
    for head, vals in zip(headers, values):
        head, at = head.tolist(), 0
        for start in range(0, len(head), per_seq):
            idx, entry = head[start], {}
            for k, name in enumerate(names):
                code, n = head[start + 1 + 2 * k], head[start + 2 + 2 * k]
                if code < 0:
                    continue
                entry[name] = vals[at : at + n].to(device, _OUTPUT_DTYPES[code])
                at += n
            out[idx] = entry
    return out


def _collect(collected, num_seqs: int, names) -> list[dict]:
    """Per-sequence outputs from the last stage's CP/DP shards onto every rank."""
    pgs = active_groups()
    last_stage = is_pp_last_stage(pgs.pp)
    mine: dict[int, dict] = {}
    if last_stage:
        cp_group = pgs.cp
        for mb, outs in collected:
            per_name = {n: mb.gather_sequences(outs[n], cp_group) for n in names if n in outs}
            for j, idx in enumerate(mb.seq_indices):
                mine[idx] = {n: vecs[j] for n, vecs in per_name.items()}
        if pgs.dp.size() > 1:
            mine = _gather_outputs(mine, names, pgs.dp)
    if pgs.pp.size() > 1:
        src = dist.get_global_rank(pgs.pp, pgs.pp.size() - 1)
        mine = collectives.broadcast_object(mine if last_stage else None, src, group=pgs.pp)
    missing = [i for i in range(num_seqs) if i not in mine]
    if missing:
        raise RuntimeError(f"no outputs for sequences {missing[:5]}")
    return [mine[i] for i in range(num_seqs)]
