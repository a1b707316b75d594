"""Which tokens a router call sees: real tokens of the micro-batch, by sample and position, per TP rank."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from megatron_rl.distributed.runtime import active_groups


@dataclasses.dataclass
class TokenMap:
    """The real tokens among the ones a router call sees, in the router's order: sequence ``j`` of
    the micro-batch owns tokens ``index[j]`` at sequence positions ``positions[j]``.  ``full`` is the
    map of this rank's whole CP shard when the router sees a sequence-parallel slice of it."""

    count: int  # tokens the router sees (padding included)
    real: torch.Tensor  # bool [count]
    seq: torch.Tensor  # long [count]: index of the token's sequence; -1 for padding
    rows: list[int]  # each sequence's sample row (from the active pass), or its index in the call
    lengths: list[int]
    index: list[torch.Tensor]
    positions: list[torch.Tensor]
    pos: torch.Tensor  # long [count]: every token's position in its sequence, in the router's order
    full: Optional["TokenMap"] = None
    _on_device: dict = dataclasses.field(default_factory=dict)

    def real_on(self, device) -> torch.Tensor:
        """``real`` on ``device``, copied once per micro-batch (not per layer)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = self.real.to(device)
        return self._on_device[key]


def _map_of(seq, pos, real, rows, lengths) -> TokenMap:
    seq = torch.where(real, seq, torch.full_like(seq, -1))
    index = [torch.nonzero(seq == j).reshape(-1) for j in range(len(lengths))]
    return TokenMap(int(seq.numel()), real, seq, rows, lengths, index, [pos[i] for i in index], pos)


def _sequence_parallel_slice(full: TokenMap, seq, pos, real, tp_rank: int, tp_size: int) -> TokenMap:
    """``full``'s tokens that TP rank ``tp_rank`` sees under sequence parallelism (a contiguous
    slice of the flattened tokens), with ``full`` attached."""
    per = pos.numel() // tp_size
    part = slice(tp_rank * per, (tp_rank + 1) * per)
    sliced = _map_of(seq[part], pos[part], real[part], full.rows, full.lengths)
    sliced.full = full
    return sliced


def token_map(mb, rows: Optional[Sequence[int]], tp_rank: int, tp_size: int, sequence_parallel: bool) -> TokenMap:
    """Where a router's tokens come from, for micro-batch ``mb`` (a ``data.microbatch.Microbatch``).

    The router sees the decoder's ``[s, b]`` tokens flattened s-major; under sequence parallelism
    only this TP rank's contiguous slice of them."""
    pos = mb.tensors["position_ids"]
    if mb.packed:
        sizes = [p // mb.cp_size for p in mb.padded_lengths]
        seq = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        pos = pos.reshape(-1)
    else:
        b, s = pos.shape
        seq = torch.arange(b)[:, None].expand(b, s).t().reshape(-1)
        pos = pos.t().reshape(-1)
    lengths = list(mb.lengths)
    real = pos < torch.tensor(lengths)[seq]
    picked = [rows[i] for i in mb.seq_indices] if rows is not None else list(mb.seq_indices)
    full = _map_of(seq, pos, real, picked, lengths)
    if not (sequence_parallel and tp_size > 1):
        return full
    return _sequence_parallel_slice(full, seq, pos, real, tp_rank, tp_size)


def inference_token_map(ctx, lengths: dict[int, int]) -> TokenMap:
    """Where a router's tokens come from in one step of megatron's dynamic inference engine
    (context ``ctx``): the step's flat tokens belong to request slots, ``lengths[request_id]`` is
    the longest that request can grow (its recording's size).  Padding to the step's rounded
    size is not real."""
    count = int(ctx.padded_active_token_count)
    active = int(ctx.active_token_count)
    slots = ctx.token_to_request_idx[:count].to("cpu", torch.long)
    pos = ctx.token_to_position_in_request[:count].to("cpu", torch.long)
    real = torch.arange(count) < active
    slots = torch.where(real, slots, torch.zeros_like(slots))
    requests = int(ctx.total_request_count)
    rows = ctx.request_ids[:requests].tolist()
    return _map_of(slots, pos, real, rows, [lengths[r] for r in rows])


def map_for_count(tmap: Optional[TokenMap], count: int) -> Optional[TokenMap]:
    """``tmap`` as a router of ``count`` tokens sees it: whole, or this TP rank's sequence-parallel
    slice of it when the router sees ``1/TP`` of the tokens (the inference engine decides per
    layer type); None when neither fits (e.g. an idle expert-parallel rank's dummy forward)."""
    if tmap is None or tmap.count == count:
        return tmap
    tp_group = active_groups().tp
    tp = tp_group.size()
    if tp > 1 and tmap.count == count * tp:
        return _sequence_parallel_slice(tmap, tmap.seq, tmap.pos, tmap.real, tp_group.rank(), tp)
    return None
