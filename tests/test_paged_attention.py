"""The paged attention kernels megatron's dynamic engine calls (``rollout.paged_attention``).

The Triton kernel (``megatron_rl/ops/paged_attention.py``) runs here in Triton's interpreter: its
math against a dense reference that attends each request alone over its pages and against the
SDPA stand-in, in fp32 (1e-5): mixed prefill chunks and decode rows in one call, keys spread over
pages out of order, GQA with a group that is not a power of two, a head size that is not one,
padding requests.  The engine-level parity (HF greedy tokens, teacher-forced log-probs) is in
tests/test_rollout_megatron_engine.py; the compiled kernel against flash-attn's is a GPU test.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.compat.inference_cpu import sdpa_decode_paged, sdpa_varlen_paged
from megatron_rl.ops.paged_attention import dense_reference, triton_decode_paged, triton_installed, triton_varlen_paged

pytestmark = pytest.mark.skipif(not triton_installed(), reason="Triton is not installed")


def paged_case(q_lens, kv_lens, heads=6, kv_heads=2, dim=24, block=4, seed=0, dtype=torch.float32):
    """Random pages and a shuffled block table for requests of ``q_lens`` new tokens among ``kv_lens`` keys."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-k // block) for k in kv_lens]
    total = sum(pages) + 3
    order = torch.randperm(total, generator=gen).tolist()
    table = torch.full((len(kv_lens), max(pages + [1]) + 1), -1, dtype=torch.int32)
    for r, n in enumerate(pages):
        table[r, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    k = torch.randn(total, block, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, block, kv_heads, dim, generator=gen).to(dtype)
    cu_q = [0]
    for n in q_lens:
        cu_q.append(cu_q[-1] + n)
    q = torch.randn(cu_q[-1], heads, dim, generator=gen).to(dtype)
    return q, k, v, cu_q, table


MIXED = dict(q_lens=[3, 5, 1, 0, 17], kv_lens=[10, 5, 13, 0, 40])  # chunk, whole prompt, decode row, padding, long


@pytest.mark.parametrize("heads,kv_heads,dim,block", [(6, 2, 24, 4), (4, 4, 16, 16), (8, 1, 64, 8)],
                         ids=["gqa3_d24_block4", "mha_d16_block16", "mqa_d64_block8"])
def test_triton_prefill_equals_each_request_attending_alone(heads, kv_heads, dim, block):
    q, k, v, cu_q, table = paged_case(**MIXED, heads=heads, kv_heads=kv_heads, dim=dim, block=block)
    kv_lens = MIXED["kv_lens"]
    cu_k = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist())
    got = triton_varlen_paged(q, k, v, torch.tensor(cu_q), cu_k, max(MIXED["q_lens"]), max(kv_lens),
                              block_table=table)
    ref = dense_reference(q, k, v, cu_q, kv_lens, table)
    stand_in = sdpa_varlen_paged(q, k, v, torch.tensor(cu_q), cu_k, block_table=table)
    print(f"max |triton - dense| {(got - ref).abs().max():.1e}, |sdpa - dense| {(stand_in - ref).abs().max():.1e}")
    assert (got - ref).abs().max() <= 1e-5
    assert (got - stand_in).abs().max() <= 1e-5
    assert got.abs().sum() > 0


def test_triton_decode_equals_the_stand_in_and_zeroes_padding_requests():
    kv_lens = [10, 7, 13, 0, 33]
    q, k, v, _, table = paged_case([1] * len(kv_lens), kv_lens)
    lengths = torch.tensor(kv_lens, dtype=torch.int32)
    got = triton_decode_paged(q[:, None], k, v, lengths, table)
    ref = dense_reference(q, k, v, list(range(len(kv_lens) + 1)), kv_lens, table)
    assert got.shape == (len(kv_lens), 1, q.size(1), q.size(2))
    assert (got[:, 0] - ref).abs().max() <= 1e-5
    assert (got - sdpa_decode_paged(q[:, None], k, v, lengths, table)).abs().max() <= 1e-5
    assert got[3].abs().max() == 0, "a request without keys (padding) gets zeros"


def test_triton_reads_no_slot_past_a_requests_length():
    """Slots past a request's keys hold anything (NaN in a reused page): they must not leak in."""
    q, k, v, cu_q, table = paged_case(**MIXED)
    k_nan, v_nan = k.clone(), v.clone()
    block = k.size(1)
    for r, n in enumerate(MIXED["kv_lens"]):
        pages = table[r][table[r] >= 0].long()
        if n % block:
            k_nan[pages[-1], n % block:] = float("nan")
            v_nan[pages[-1], n % block:] = float("nan")
    cu_k = torch.tensor([0] + torch.tensor(MIXED["kv_lens"]).cumsum(0).tolist())
    got = triton_varlen_paged(q, k_nan, v_nan, torch.tensor(cu_q), cu_k, 17, 40, block_table=table)
    ref = triton_varlen_paged(q, k, v, torch.tensor(cu_q), cu_k, 17, 40, block_table=table)
    assert torch.isfinite(got).all() and torch.equal(got, ref)


def test_triton_refuses_what_it_does_not_compute():
    q, k, v, cu_q, table = paged_case([2], [5])
    cu_k = torch.tensor([0, 5])
    with pytest.raises(NotImplementedError, match="sliding window"):
        triton_varlen_paged(q, k, v, torch.tensor(cu_q), cu_k, block_table=table, window_size=(4, 0))
    with pytest.raises(NotImplementedError, match="LSE"):
        triton_varlen_paged(q, k, v, torch.tensor(cu_q), cu_k, block_table=table, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="one query per request"):
        triton_decode_paged(torch.zeros(1, 2, 6, 24), k, v, torch.tensor([5], dtype=torch.int32), table)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel runs on CUDA")
def test_compiled_triton_kernel_equals_the_reference_in_bf16_and_fp32():
    for dtype, bound in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        q, k, v, cu_q, table = paged_case(**MIXED, heads=12, kv_heads=2, dim=128, block=16, dtype=dtype)
        ref = dense_reference(q.float(), k.float(), v.float(), cu_q, MIXED["kv_lens"], table)
        cu_k = torch.tensor([0] + torch.tensor(MIXED["kv_lens"]).cumsum(0).tolist())
        got = triton_varlen_paged(q.cuda(), k.cuda(), v.cuda(), torch.tensor(cu_q).cuda(), cu_k.cuda(), 17, 40,
                                  block_table=table.cuda())
        assert (got.float().cpu() - ref).abs().max() <= bound, dtype


def test_auto_picks_the_stand_in_on_the_cpu_and_triton_on_cuda_without_flash_attn(monkeypatch):
    from megatron_rl.compat import paged_attention as pa

    assert pa.pick_paged_attention("auto", cuda=False) == "sdpa"
    monkeypatch.setattr(pa, "_flash_installed", lambda: False)
    assert pa.pick_paged_attention("auto", cuda=True) == "triton"
    monkeypatch.setattr(pa, "_flash_installed", lambda: True)
    assert pa.pick_paged_attention("auto", cuda=True) == "flash_attn"
    assert pa.pick_paged_attention("triton", cuda=True) == "triton"
    assert "CUDA only" in pa.paged_attention_refusal("flash_attn", cuda=False)
    assert pa.paged_attention_refusal("triton", cuda=False) == ""


def test_installing_kernels_rebinds_megatrons_names_and_puts_flash_attns_back():
    from megatron.core.transformer import attention

    from megatron_rl.compat.paged_attention import _ORIGINAL, install_paged_attention, installed_paged_attention

    install_paged_attention("triton")
    assert attention.flash_attn_varlen_func is triton_varlen_paged
    assert attention.flash_attn_with_kvcache is triton_decode_paged
    assert installed_paged_attention() == "triton" and not attention.HAVE_FA3 and not attention.HAVE_FA4
    install_paged_attention("sdpa")
    assert installed_paged_attention() == "sdpa"
    install_paged_attention("flash_attn")
    assert attention.flash_attn_varlen_func is _ORIGINAL["flash_attn_varlen_func"]
    assert attention.is_fa_min_version is _ORIGINAL["is_fa_min_version"]
