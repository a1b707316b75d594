"""Packed (THD) causal attention at CP=1: bucketed fused calls equal attention per sequence.

The packed path gathers sequences of similar length into padded batches; padding sits at the end
of each sequence, where the causal mask hides it from real tokens.  Outputs and q/k/v gradients
must equal plain attention run sequence by sequence, whether everything fits one call (short
sequences) or the lengths split into several buckets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.ops import packed_attention
from megatron_rl.ops.packed_attention import packed_causal_attention

CASES = {
    "short_mixed": ([13, 1, 30, 2, 7, 3, 21] * 4, 1),  # one call: padding is cheaper than calls
    "long_and_short": ([400, 3, 390, 40, 5], 2),  # 400/390 together, 40/5/3 together
}


def _per_sequence(q, k, v, cu, scale):
    return torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                                     scale=scale, enable_gqa=True)
                      for s, e in zip(cu[:-1], cu[1:])], dim=2)


@pytest.mark.parametrize("case", list(CASES))
def test_packed_attention_matches_attention_per_sequence(case, monkeypatch):
    lengths, calls = CASES[case]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, cu[-1], 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, cu[-1], 8, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(1, 4, cu[-1], 8, generator=g, dtype=torch.float64)
    scale = 8**-0.5

    seen = []
    sdpa = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        seen.append(args[0].shape)
        return sdpa(*args, **kwargs)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention", counted)
    out = packed_causal_attention(*leaves, tuple(cu), scale)
    monkeypatch.undo()
    out.backward(do)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _per_sequence(*ref_leaves, cu, scale)
    ref.backward(do)

    assert len(seen) == calls, seen
    assert float((out - ref).detach().abs().max()) <= 1e-12
    for got, want in zip(leaves, ref_leaves):
        assert float((got.grad - want.grad).abs().max()) <= 1e-12
