"""Fused attention blocks that return their log-sum-exp, and their backward.

Context-parallel attention merges partial results of several (query block, key block) pairs.
That needs each block's output *and* its per-row log-sum-exp, and a backward that takes the
merged output and log-sum-exp instead of the block's own: flash-attention's backward only uses
``out`` (for ``rowsum(dO * O)``) and ``lse`` (to rebuild the probabilities), so calling it once
per block with the merged values gives exact gradients of the merged attention.  torch's SDPA
front end returns neither, so this module calls torch's own fused kernels directly:

* CPU: the flash-attention CPU kernel (float64, float32, bfloat16, float16; GQA native);
* CUDA, bfloat16/float16: the flash-attention kernel (K/V heads repeated for GQA);
* CUDA, float32: the memory-efficient kernel, cut by heads so no call exceeds 2**31 score
  elements (above 2**32 it returns wrong rows, pytorch#187227).

Shapes: ``q`` ``[b, heads, sq, d]``, ``k``/``v`` ``[b, kv_heads, sk, d]``; ``lse`` ``[b, heads, sq]``
in float32 (float64 for float64 input).  ``causal`` is top-left aligned and only used with
``sq == sk`` (a diagonal block), where top-left and bottom-right alignment agree.
No mask tensor is ever built: a block is fully visible or causal-diagonal.
"""

from __future__ import annotations

import torch

_CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_HALF = (torch.bfloat16, torch.float16)
# The memory-efficient kernel indexes scores with 32-bit offsets (pytorch#187227).
_MAX_SCORES_PER_CALL = 2**31


def attention_forward(q, k, v, causal: bool, scale: float):
    """``(out, lse)`` of softmax attention of ``q`` over ``k``/``v``; ``out`` in ``q``'s dtype."""
    if q.device.type == "cpu":
        out, lse = _CPU_FORWARD(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if q.device.type == "cuda" and q.dtype in _HALF:
        return _cuda_flash_forward(q, repeat_kv(k, q), repeat_kv(v, q), causal, scale)
    if q.device.type == "cuda":
        return _cuda_efficient_forward(q, repeat_kv(k, q), repeat_kv(v, q), causal, scale)
    raise NotImplementedError(f"no fused attention kernel for {q.device.type} tensors")


def attention_backward(do, q, k, v, out, lse, causal: bool, scale: float):
    """``(dq, dk, dv)`` of the block, given the *merged* ``out`` and ``lse`` of its rows."""
    if q.device.type == "cpu":
        return _CPU_BACKWARD(do, q, k, v, out.to(q.dtype), lse, 0.0, causal, scale=scale)
    kr, vr = repeat_kv(k, q), repeat_kv(v, q)
    if q.dtype in _HALF:
        dq, dk, dv = _cuda_flash_backward(do, q, kr, vr, out.to(q.dtype), lse, causal, scale)
    else:
        dq, dk, dv = _cuda_efficient_backward(do, q, kr, vr, out.to(q.dtype), lse, causal, scale)
    return dq, _sum_kv_groups(dk, k), _sum_kv_groups(dv, v)


def repeat_kv(x, q):
    """K/V heads repeated to the query heads, dimension 1 of both (``[b, heads, s, d]`` or packed
    ``[t, heads, d]``): the CUDA kernels called here take equal heads."""
    groups = q.size(1) // x.size(1)
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_kv_groups(grad, like):
    groups = grad.size(1) // like.size(1)
    if groups == 1:
        return grad
    b, _, s, d = grad.shape
    return grad.view(b, like.size(1), groups, s, d).sum(2)


def _cuda_flash_forward(q, k, v, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _cuda_flash_backward(do, q, k, v, out, lse, causal, scale):
    # No sequence offsets: None is the undefined tensor the dense forward returns for them (what
    # torch's own autograd passes back).  An empty tensor is a defined one, which the kernel reads
    # as variable-length offsets of -1 sequences ("batch size must be positive", torch 2.11 CUDA).
    # The kernel reads ``lse`` as a contiguous [b, heads, rows] block whatever its strides: a CP
    # block's rows of the accumulator (a slice along rows) gave other heads' values (H200).
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), None, None, q.size(2), k.size(2), 0.0, causal,
        no_rng, no_rng, scale=scale,
    )


def _head_slices(q, k):
    b, h, sq, _ = q.shape
    per_head = b * sq * k.size(2)
    step = max(1, min(h, _MAX_SCORES_PER_CALL // max(1, per_head)))
    return [slice(a, min(h, a + step)) for a in range(0, h, step)]


def _cuda_efficient_forward(q, k, v, causal, scale):
    outs, lses = [], []
    for hs in _head_slices(q, k):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q[:, hs], k[:, hs], v[:, hs], None, True, 0.0, causal, scale=scale
        )
        outs.append(out)
        lses.append(lse[..., : q.size(2)])  # the kernel pads rows to a multiple of 32
    return torch.cat(outs, 1), torch.cat(lses, 1)


def _cuda_efficient_backward(do, q, k, v, out, lse, causal, scale):
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)
    padded = -(-q.size(2) // 32) * 32
    lse = torch.nn.functional.pad(lse, (0, padded - q.size(2)))
    grads = []
    for hs in _head_slices(q, k):
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do[:, hs].contiguous(), q[:, hs], k[:, hs], v[:, hs], None, out[:, hs], lse[:, hs].contiguous(),
            no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale,
        )
        grads.append((dq, dk, dv))
    return tuple(torch.cat(parts, 1) for parts in zip(*grads))


# ----------------------------------------------------------------------------- packed blocks (CUDA)


def varlen_ready(q) -> bool:
    """Whether packed sequences' blocks run as one variable-length kernel call: CUDA flash
    attention, half precision.  Elsewhere (the CPU, fp32) each sequence's block is its own call."""
    return q.device.type == "cuda" and q.dtype in _HALF


def varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """``(out, lse)`` of packed blocks: ``q`` ``[total_q, heads, d]``, ``k``/``v`` ``[total_k,
    kv_heads, d]``, block ``i`` = rows ``cu_q[i]:cu_q[i+1]`` over ``cu_k[i]:cu_k[i+1]`` (int32 on
    the device); ``lse`` ``[heads, total_q]`` float32 (flash-attention's varlen layout)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, repeat_kv(k, q), repeat_kv(v, q), cu_q, cu_k, max_q, max_k, 0.0, causal, False,
        scale=scale,
    )
    return out, lse


def varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float):
    """``(dq, dk, dv)`` of packed blocks given the *merged* ``out`` and ``lse`` of their rows."""
    no_rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        do.contiguous(), q, repeat_kv(k, q), repeat_kv(v, q), out.to(q.dtype), lse.contiguous(),
        cu_q, cu_k, max_q, max_k, 0.0, causal, no_rng, unused, scale=scale,
    )
    groups = q.size(1) // k.size(1)
    if groups > 1:
        dk = dk.view(dk.size(0), k.size(1), groups, dk.size(-1)).sum(2)
        dv = dv.view(dv.size(0), k.size(1), groups, dv.size(-1)).sum(2)
    return dq, dk, dv


def merge_into(acc_out, acc_lse, out, lse) -> None:
    """Fold a partial ``(out, lse)`` into running ones, in place (views allowed)."""
    merged = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    acc_out.mul_(torch.exp(acc_lse - merged).unsqueeze(-1))
    acc_out.add_(out.to(acc_out.dtype) * torch.exp(lse.to(acc_lse.dtype) - merged).unsqueeze(-1))
    acc_lse.copy_(merged)
