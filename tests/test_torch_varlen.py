"""The packed-row flash call on CUDA, built for the installed torch's ``varlen_attn`` signature.

torch 2.11's ``varlen_attn`` has no ``enable_gqa``: the GQA training forward raised ``TypeError``
there at its first packed micro-batch (found on an H200 by benchmarks/gpu_check.py).  The kernel
is CUDA-only, so each signature is stood in for by a per-sequence SDPA with that signature's
semantics, and the result compared with the CPU path of the same attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.ops import torch_varlen
from megatron_rl.ops.packed_attention import packed_causal_attention


def _reference(q, k, v, cu, causal: bool, scale=None):
    """What the kernel computes: per-sequence attention, equal heads, default scale 1/sqrt(d)."""
    assert q.size(1) == k.size(1), "the kernel stood in for takes no GQA without enable_gqa"
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    """torch 2.11's signature, as the H200 printed it."""
    return _reference(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), scale)


def varlen_is_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    """An earlier signature: is_causal, no scale."""
    return _reference(query, key, value, cu_seq_q, is_causal)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False):
    if enable_gqa:
        groups = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return _reference(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), scale)


@pytest.mark.parametrize("fn", [varlen_2_11, varlen_is_causal, varlen_2_13],
                         ids=["torch2.11", "is_causal", "torch2.13"])
def test_the_packed_flash_call_fits_each_signature_and_equals_the_cpu_path(monkeypatch, fn):
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", fn)
    g = torch.Generator().manual_seed(0)
    heads, kv, d, cu = 8, 2, 16, (0, 5, 12, 30)
    q = torch.randn(1, heads, cu[-1], d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, kv, cu[-1], d, generator=g, dtype=torch.float64) for _ in range(2))
    scale = 0.7 / math.sqrt(d)  # not the kernel's default: a dropped scale would show
    out = torch_varlen.causal_varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                               torch.tensor(cu, dtype=torch.int32), max(30 - 12, 7), scale)
    expected = packed_causal_attention(q, k, v, cu, scale)
    torch.testing.assert_close(out.transpose(0, 1).unsqueeze(0), expected, rtol=1e-12, atol=1e-12)
