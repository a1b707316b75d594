"""Turn a few sequences into one micro-batch, *as this rank holds it*, on the host.

Each sequence is a dict of 1-D host tensors aligned with its input positions: ``tokens`` plus any
per-position fields (``loss_mask``, ``old_logprob``, ``advantages``...).  Position ``t`` of a
field belongs to the prediction of token ``t+1``; labels are built here by shifting ``tokens``
*before* anything is split, so every rank's labels line up with its inputs.

Two layouts:

* packed (THD): sequences are concatenated into one row, each padded to a multiple of the
  alignment (``2*cp``, times ``tp`` under sequence parallelism); attention never crosses
  sequences (``cu_seqlens``), and RoPE positions restart per sequence;
* unpacked (BSHD): one row per sequence, right-padded to the longest (aligned) length.

With context parallelism every sequence (packed) or row (unpacked) is cut into ``2*cp`` chunks and
this rank keeps chunks ``r`` and ``2*cp-1-r`` -- all on the host, so only ``1/cp`` of the tokens
ever reach this rank's device.  :meth:`Microbatch.gather_sequences` undoes the split for
per-token outputs (log-probs, values) after gathering them over the CP group as ``[T]`` vectors.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.ops import zigzag


def align_to(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def alignment(cp: int, tp: int, sequence_parallel: bool) -> int:
    """Padding multiple for one sequence: ``2*cp`` for the zigzag split, ``x tp`` under SP."""
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


@dataclasses.dataclass
class Microbatch:
    seq_indices: list[int]
    lengths: list[int]
    padded_lengths: list[int]
    packed: bool
    cp_size: int
    cp_rank: int
    tensors: dict  # name -> host tensor, [1, T_local] packed or [B, S_local] unpacked
    # :meth:`row_index` per device, built at its first use
    _row_index: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def local_tokens(self) -> int:
        return int(self.tensors["tokens"].numel())

    @property
    def local_sizes(self) -> list[int]:
        """Packed: each sequence's slots in this rank's row (its padded length over CP)."""
        return [p // self.cp_size for p in self.padded_lengths]

    def to(self, device: torch.device, names: Optional[Iterable[str]] = None) -> dict:
        """This rank's shard of the named tensors on ``device`` (all of them by default); to CUDA
        through pinned memory, so the copies do not wait for the device."""
        names = self.tensors.keys() if names is None else names
        return {n: zigzag.to_device(self.tensors[n], device) for n in names}

    def packed_seq_params(self, device: torch.device):
        """THD parameters for this micro-batch; the ``cu_seqlens`` tensors carry their values on
        the host (:func:`megatron_rl.ops.zigzag.host_values`), so no layer reads them back."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        cu_pad = _cu_tensor(self.padded_lengths, device)
        cu = _cu_tensor(self.lengths, device)
        # Real lengths sit at the start of their padded slots: TransformerEngine reads both,
        # our local attention and megatron's RoPE use the padded offsets.
        longest = max(self.padded_lengths)
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_pad,
            cu_seqlens_kv_padded=cu_pad,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )

    def row_index(self, device: torch.device) -> torch.Tensor:
        """``[num_seqs, longest local piece]`` positions of each sequence's local piece in the packed
        row, ``local_tokens`` (one past the end) where a row is padding; built on the host once per
        micro-batch and device.  One gather with it turns a packed per-token tensor into one row per
        sequence: a fixed number of kernels, where a pad of per-sequence slices costs a few per
        sequence (and as many again in backward)."""
        key = str(device)
        if key not in self._row_index:
            sizes = torch.tensor(self.local_sizes)
            starts = torch.cumsum(sizes, 0) - sizes
            cols = torch.arange(int(sizes.max()) if len(sizes) else 0)
            index = torch.where(cols[None, :] < sizes[:, None], starts[:, None] + cols[None, :],
                                torch.full((1, 1), self.local_tokens))
            self._row_index[key] = zigzag.to_device(index, device)
        return self._row_index[key]

    def local_pieces(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-token local output (shape of ``tokens``) into per-sequence local pieces."""
        if self.packed:
            return list(torch.split(local.reshape(-1), self.local_sizes))
        return [row for row in local]

    def gather_sequences(self, local: torch.Tensor, cp_group=None) -> list[torch.Tensor]:
        """Full per-sequence vectors ``[length]`` from a per-token output of this micro-batch.

        Only ``[T]`` vectors travel over the CP group (never logits), and they come to the host in
        one copy: one wait for the device per micro-batch, not one per sequence."""
        local = local.detach().float().contiguous()
        if self.cp_size > 1:
            shards = [torch.empty_like(local) for _ in range(self.cp_size)]
            dist.all_gather(shards, local, group=cp_group)
        else:
            shards = [local]
        shards = list(torch.stack(shards).cpu())
        per_rank = [self.local_pieces(s) for s in shards]
        out = []
        for i, length in enumerate(self.lengths):
            full = zigzag.unshard([pieces[i] for pieces in per_rank], dim=0)
            out.append(full[:length])
        return out


def _cu_tensor(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """Global int32 ``cu_seqlens`` on ``device``, with their host values attached."""
    values = [0] + list(_cumsum(lengths))
    return zigzag.with_host_values(zigzag.to_device(torch.tensor(values, dtype=torch.int32), device), values)


def _cumsum(values: Sequence[int]):
    total = 0
    for v in values:
        total += v
        yield total


def build_microbatch(
    seqs: Sequence[dict],
    seq_indices: Sequence[int],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    align: int = 1,
    packed: bool = True,
    pad_id: int = 0,
) -> Microbatch:
    """Pad, (pack,) shift labels and take this CP rank's zigzag shard, all on the host."""
    if not seqs:
        raise ValueError("a micro-batch needs at least one sequence")
    names = [n for n in seqs[0] if n != "tokens"]
    lengths = [int(s["tokens"].numel()) for s in seqs]
    if packed:
        padded = [align_to(n, align) for n in lengths]
    else:
        row = align_to(max(lengths), align)
        padded = [row] * len(seqs)

    if packed:
        tensors = _packed(seqs, names, lengths, padded, cp_size, cp_rank, pad_id)
        return Microbatch(list(seq_indices), lengths, padded, packed, cp_size, cp_rank, tensors)

    def prepared(seq: dict, padded_len: int) -> dict:
        tokens = seq["tokens"].long()
        n = tokens.numel()
        out = {
            "tokens": _pad(tokens, padded_len, pad_id),
            "labels": _pad(torch.cat([tokens[1:], tokens.new_full((1,), pad_id)]), padded_len, pad_id),
            "position_ids": torch.arange(padded_len),
        }
        for name in names:
            out[name] = _pad(_checked(seq, name, n), padded_len, 0)
        return {k: zigzag.shard(v, cp_size, cp_rank, dim=0) for k, v in out.items()}

    pieces = [prepared(s, p) for s, p in zip(seqs, padded)]
    tensors = {k: torch.stack([p[k] for p in pieces]) for k in pieces[0]}
    return Microbatch(list(seq_indices), lengths, padded, packed, cp_size, cp_rank, tensors)


def _checked(seq: dict, name: str, n: int) -> torch.Tensor:
    value = seq[name]
    if value.numel() != n:
        raise ValueError(f"field {name!r} has {value.numel()} entries for a {n}-token sequence")
    return value


def _packed(seqs, names, lengths, padded, cp_size: int, cp_rank: int, pad_id: int) -> dict:
    """The packed row of every field, built with a few whole-batch ops (a micro-batch of short
    sequences has hundreds of them; per-sequence pad/cat/shard would be ten small ops each).
    Sequence ``i`` occupies ``padded[i]`` slots from its packed offset, its real tokens first."""
    lengths_t, padded_t = torch.tensor(lengths), torch.tensor(padded)
    slot_starts = torch.cumsum(padded_t, 0) - padded_t
    token_starts = torch.cumsum(lengths_t, 0) - lengths_t
    total = int(sum(padded))
    # Packed slot of every real token: its index in the concatenation, moved by its sequence's padding.
    dest = torch.arange(int(sum(lengths))) + torch.repeat_interleave(slot_starts - token_starts, lengths_t)
    last = torch.cumsum(lengths_t, 0) - 1  # each sequence's last token in the concatenation

    def packed_row(flat: torch.Tensor, fill) -> torch.Tensor:
        return flat.new_full((total,), fill).index_copy_(0, dest, flat)

    tokens = torch.cat([s["tokens"] for s in seqs]).long()
    labels = torch.empty_like(tokens)
    labels[:-1] = tokens[1:]
    labels[last] = pad_id  # the token after a sequence's last one is not its label
    out = {
        "tokens": packed_row(tokens, pad_id),
        "labels": packed_row(labels, pad_id),
        "position_ids": torch.arange(total) - torch.repeat_interleave(slot_starts, padded_t),
    }
    for name in names:
        out[name] = packed_row(torch.cat([_checked(s, name, n) for s, n in zip(seqs, lengths)]), 0)
    if cp_size > 1:  # this rank's zigzag shard of every sequence, in packed order
        keep = torch.cat([start + zigzag.zigzag_index(p, cp_size, cp_rank)
                          for start, p in zip(slot_starts.tolist(), padded)])
        out = {k: v.index_select(0, keep) for k, v in out.items()}
    return {k: v.unsqueeze(0) for k, v in out.items()}


def _pad(x: torch.Tensor, length: int, value) -> torch.Tensor:
    if x.numel() == length:
        return x
    return torch.cat([x, x.new_full((length - x.numel(),), value)])
