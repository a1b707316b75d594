"""Packed micro-batches are built with whole-batch ops; they must hold exactly what padding, shifting
and sharding each sequence on its own gives (the unpacked builder still does that, row by row)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.data.microbatch import align_to, build_microbatch
from megatron_rl.ops import zigzag


def one_by_one(seqs, cp_size, cp_rank, align, pad_id):
    """The packed row built sequence by sequence: pad, shift labels, shard, concatenate."""
    rows: dict = {}
    for seq in seqs:
        tokens = seq["tokens"].long()
        n, p = tokens.numel(), align_to(tokens.numel(), align)
        out = {"tokens": torch.cat([tokens, tokens.new_full((p - n,), pad_id)]),
               "labels": torch.cat([tokens[1:], tokens.new_full((p - n + 1,), pad_id)]),
               "position_ids": torch.arange(p)}
        for name, value in seq.items():
            if name != "tokens":
                out[name] = torch.cat([value, value.new_zeros(p - n)])
        for k, v in out.items():
            rows.setdefault(k, []).append(zigzag.shard(v, cp_size, cp_rank, dim=0))
    return {k: torch.cat(v).unsqueeze(0) for k, v in rows.items()}


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_packed_microbatch_equals_sequence_by_sequence(cp_size):
    gen = torch.Generator().manual_seed(cp_size)
    lengths = [1, 7, 12, 2, 5, 9]
    seqs = [{"tokens": torch.randint(3, 50, (n,), generator=gen),
             "loss_mask": (torch.rand(n, generator=gen) > 0.3).float(),
             "advantages": torch.randn(n, generator=gen, dtype=torch.float64)} for n in lengths]
    align = 2 * cp_size
    for rank in range(cp_size):
        mb = build_microbatch(seqs, list(range(len(seqs))), cp_size=cp_size, cp_rank=rank, align=align, pad_id=1)
        want = one_by_one(seqs, cp_size, rank, align, pad_id=1)
        assert mb.tensors.keys() == want.keys()
        for k in want:
            assert mb.tensors[k].dtype == want[k].dtype and torch.equal(mb.tensors[k], want[k]), (k, rank)
