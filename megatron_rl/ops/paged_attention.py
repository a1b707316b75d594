"""Paged attention in Triton: what megatron-core's dynamic inference engine asks of flash-attn.

megatron-core 0.19's ``DynamicInferenceEngine`` keeps keys and values in pages
(``[blocks, block_size, kv_heads, d]``) and calls flash-attn's ``flash_attn_varlen_func`` with a
``block_table`` for prefill and mixed steps and ``flash_attn_with_kvcache`` for decode-only steps.
flash-attn is missing from many GPU images (PyPI carries its source only, hours to build), and
torch ships no paged kernel: ``flex_attention`` needs a block mask rebuilt from the page table on
every step (host work between kernels, and a recompilation whenever the shapes move), which a CUDA
graph cannot hold.  This kernel reads the page table itself, so one launch does a step's attention
for every request, with no host synchronisation -- a CUDA graph captures it as it is.

One program computes a tile of ``BLOCK_Q`` query tokens of one request for every query head of one
KV head (GQA: the heads sharing a KV head read each page once), walking the request's pages up to
its causal limit with an online softmax in fp32.  Causality is aligned to the end of the keys, as
flash-attn's is: the query at chunk offset ``j`` of a request with ``q_len`` new tokens and
``kv_len`` keys sees keys ``< kv_len - q_len + j + 1``.  Padding requests (no keys or no queries)
and padding tokens get zeros.

The math is checked on the CPU by Triton's interpreter (``interpret=True``) against the SDPA
stand-in and a dense reference (tests/test_paged_attention.py); on the CPU the engine uses the SDPA
stand-in (:mod:`megatron_rl.compat.inference_cpu`), which the interpreter cannot approach in speed.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

LOG2E = 1.4426950408889634
# Key slots per inner iteration; query tokens per program for prefill tiles.
BLOCK_N = 64
PREFILL_BLOCK_Q = 16
# Rows of a program's tile (query tokens x the query heads of one KV head): tl.dot needs at least
# 16; past 128 the fp32 accumulator no longer fits a program's registers.
MIN_ROWS, MAX_ROWS = 16, 128


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


try:  # Triton ships with torch's CUDA wheels; a CPU-only torch may come without it
    import triton.language as tl
except ImportError:  # pragma: no cover - every tested stack has Triton
    tl = None


def triton_installed() -> bool:
    return tl is not None


# The kernel uses Triton's builtins and ``tl.reduce`` with the standard library's own combine
# functions (what ``tl.max`` / ``tl.sum`` call) rather than the library's ``@jit`` helpers: Triton's
# interpreter runs those helpers only when TRITON_INTERPRET was set before triton was imported,
# while the builtins and these two reductions (numpy there) run in any process.
if tl is not None:
    _MAX = tl.standard._elementwise_max
    _SUM = tl.standard._sum_combine


if tl is not None:

    def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr,
        cu_q_ptr, kv_len_ptr, table_ptr,
        scale_log2,
        stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_ot, stride_oh,
        stride_table,
        block_size,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DECODE: tl.constexpr, IEEE: tl.constexpr,
    ):
        request = tl.program_id(0)
        tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        kv_len = tl.load(kv_len_ptr + request)
        # A padding request (no keys) computes nothing: its rows keep the zeros they were given.
        if DECODE:
            q_start = request
            q_len = (kv_len > 0).to(tl.int32)
        else:
            q_start = tl.load(cu_q_ptr + request)
            q_len = tl.where(kv_len > 0, tl.load(cu_q_ptr + request + 1) - q_start, 0)
        tile_start = tile * BLOCK_Q
        if tile_start < q_len:
            rows = tl.arange(0, BLOCK_M)
            token = tile_start + rows // GROUP_PAD  # the query's offset in its request's chunk
            head = kv_head * GROUP + rows % GROUP_PAD
            row_ok = (rows // GROUP_PAD < BLOCK_Q) & (rows % GROUP_PAD < GROUP) & (token < q_len)
            dims = tl.arange(0, HEAD_DIM_PAD)
            dim_ok = dims < HEAD_DIM
            q_rows = (q_start + token).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
            q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

            # The last key each row sees (causal, aligned to the end of the keys).
            last_key = kv_len - q_len + token
            tile_last = kv_len - q_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
            stop = tl.minimum(tile_last + 1, kv_len)

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
            acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
            slots = tl.arange(0, BLOCK_N)
            for start in range(0, stop, BLOCK_N):
                key = start + slots
                key_ok = key < stop
                page = tl.load(table_ptr + request * stride_table + key // block_size, mask=key_ok, other=0)
                page = tl.maximum(page, 0).to(tl.int64)
                within = (key % block_size).to(tl.int64)
                k_rows = page * stride_kb + within * stride_ks + kv_head * stride_kh
                v_rows = page * stride_vb + within * stride_vs + kv_head * stride_vh
                kv_mask = key_ok[:, None] & dim_ok[None, :]
                k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale_log2
                visible = key_ok[None, :] & (key[None, :] <= last_key[:, None]) & row_ok[:, None]
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_rows = (q_start + token).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
            tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & dim_ok[None, :])


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The compiled kernel, or the same source run by Triton's interpreter (CPU tensors)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(paged_attention_kernel)
    import triton

    return triton.jit(paged_attention_kernel)


def _launch(q, k_cache, v_cache, out, cu_q, kv_lens, table, scale, grid_q: int, decode: bool, block_q: int):
    """``q``/``out`` ``[tokens, heads, d]``; one program per (request, query tile, KV head)."""
    tokens, heads, dim = q.shape
    kv_heads = k_cache.size(2)
    if heads % kv_heads:
        raise ValueError(f"paged attention: {heads} query heads do not share {kv_heads} KV heads evenly")
    requests = table.size(0)
    if requests == 0 or tokens == 0:
        return out
    group = heads // kv_heads
    group_pad = _next_pow2(group)
    # A tile holds every query head of its tokens; more tokens where the rows allow (decode: one).
    block_m = max(MIN_ROWS, group_pad, min(MAX_ROWS, _next_pow2(block_q * group_pad)))
    block_q = block_m // group_pad
    interpret = q.device.type != "cuda"
    grid = (requests, max(1, -(-grid_q // block_q)), kv_heads)
    _kernel(interpret)[grid](
        q, k_cache, v_cache, out, cu_q, kv_lens, table,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        table.stride(0),
        k_cache.size(1),
        HEAD_DIM=dim, HEAD_DIM_PAD=max(16, _next_pow2(dim)), GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N, DECODE=decode, IEEE=q.dtype == torch.float32,
    )
    return out


def _check_layout(k_cache, window_size, lse: bool) -> None:
    if window_size is not None and tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"the Triton paged attention has no sliding window (window_size={window_size})")
    if lse:
        raise NotImplementedError("the Triton paged attention returns no softmax LSE (sink softmax)")
    if k_cache.stride(-1) != 1:
        raise ValueError("paged attention needs the KV pages contiguous in the head dimension")


def triton_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                        softmax_scale=None, causal=True, block_table=None, window_size=None,
                        return_attn_probs=False, **_unused):
    """flash-attn's ``flash_attn_varlen_func`` over a ``block_table``: ``q [tokens, heads, d]``
    packs every request's new tokens (``cu_seqlens_q``); ``k``/``v`` are the paged caches already
    holding them; request ``i`` has ``cu_seqlens_k[i+1] - cu_seqlens_k[i]`` keys."""
    _check_layout(k, window_size, return_attn_probs)
    if not causal:
        raise NotImplementedError("the Triton paged attention is causal (generation)")
    if block_table is None:
        raise ValueError("the Triton paged attention reads keys through a block_table")
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    cu_q = cu_seqlens_q.to(torch.int32)
    kv_lens = cu_seqlens_k.diff().to(torch.int32)
    if max_seqlen_q is None:  # no host read on megatron's path: it passes the bound it knows
        max_seqlen_q = int(cu_q.diff().max()) if cu_q.numel() > 1 else 0
    out = torch.zeros_like(q)
    return _launch(q.contiguous(), k, v, out, cu_q, kv_lens, block_table, scale, int(max_seqlen_q),
                   decode=False, block_q=PREFILL_BLOCK_Q)


def triton_decode_paged(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True,
                        window_size=None, return_softmax_lse=False, **_unused):
    """flash-attn's ``flash_attn_with_kvcache`` over a ``block_table`` with one query per request
    (decode): ``q [b, 1, heads, d]`` -> ``[b, 1, heads, d]``; requests without keys get zeros."""
    _check_layout(k_cache, window_size, return_softmax_lse)
    if q.size(1) != 1:  # several queries per request: speculative decoding, which is off
        raise NotImplementedError(f"the Triton paged decode takes one query per request, got {q.size(1)}")
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    flat = q[:, 0].contiguous()
    out = torch.zeros_like(flat)
    _launch(flat, k_cache, v_cache, out, cache_seqlens, cache_seqlens.to(torch.int32), block_table, scale, 1,
            decode=True, block_q=1)
    return out[:, None]


def dense_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_q: list[int],
                    kv_lens: list[int], table: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Each request's attention computed alone from its pages (a loop, for tests)."""
    scale = scale if scale is not None else q.size(-1) ** -0.5
    out = torch.zeros_like(q)
    block = k_cache.size(1)
    for r in range(len(kv_lens)):
        q_len, kv_len = cu_q[r + 1] - cu_q[r], kv_lens[r]
        if q_len == 0 or kv_len == 0:
            continue
        slots = torch.arange(kv_len)
        pages = table[r, slots // block].long()
        keys, values = k_cache[pages, slots % block], v_cache[pages, slots % block]  # [kv_len, kv_heads, d]
        group = q.size(1) // keys.size(1)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        queries = q[cu_q[r]:cu_q[r + 1]].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys.float()) * scale
        visible = slots[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[cu_q[r]:cu_q[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.float()).to(q.dtype)
    return out
