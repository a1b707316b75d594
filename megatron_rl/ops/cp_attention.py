"""Context-parallel causal attention without TransformerEngine, on fused kernels.

Every rank holds a zigzag shard of each sequence (see :mod:`megatron_rl.ops.zigzag`): of a
sequence cut into ``2*cp`` chunks, rank ``r`` keeps chunks ``r`` and ``2*cp-1-r`` (its two
*halves*).  The layout is described by the sequences' global padded offsets ``cu`` (a packed row:
one entry per sequence; unpacked rows: ``(0, S)``, every row alike), known on the host.

With that layout every (query half, key half) pair is fully visible, causal-diagonal or
invisible, so no mask tensor of any size is built.  Against the keys of rank ``src``, rank
``r``'s queries of one sequence see:

* ``src == r``: their own two halves, causally (one causal kernel call);
* ``src <  r``: the first key half only, fully (all queries x half the keys);
* ``src >  r``: everything, but only from the second query half (half the queries x all keys);

so every rank does the same work per step -- the zigzag balance holds inside the ring.  Each
call is a fused kernel returning ``(out, lse)`` (:mod:`megatron_rl.ops.attention_kernels`); on
CUDA in half precision the blocks of a packed row's sequences are one variable-length flash
call per step (:class:`PackedBlocks`), elsewhere one call per sequence;
partial results merge through the log-sum-exp, and backward calls the kernels' backward with
the merged output and log-sum-exp.

Strategies (``parallel.cp_comm_type``):

``p2p``
    Ring: K/V travel around the CP group in the model dtype, the next hop overlapping the current
    block; backward sends K/V ahead the same way and the K/V gradients back to their owners.
``all_gather``
    K/V gathered once in the model dtype, then the same per-block calls; backward gathers again
    and reduce-scatters the K/V gradients, so saved activations stay ``O(S/cp)``.
``a2a``
    Ulysses: an all-to-all turns sequence shards into head shards, one causal attention runs over
    the whole sequence per head group, another all-to-all turns it back.  Needs
    ``heads % cp == 0``; K/V heads are split when ``kv_heads % cp == 0`` and replicated when
    ``cp % kv_heads == 0``.
``a2a+p2p``
    a2a inside groups of consecutive CP ranks, ring across the groups: after the inner
    all-to-all a group holds exactly the zigzag halves of a ring of ``cp / a2a`` members.

Shapes: ``q`` is ``[b, heads, s, d]``, ``k``/``v`` are ``[b, kv_heads, s, d]`` (GQA allowed).
Nothing here reads a value back from the device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.config.choices import CP_COMM_TYPES
from megatron_rl.ops import attention_kernels
from megatron_rl.ops.attention_kernels import attention_backward, attention_forward, merge_into
from megatron_rl.ops.packed_attention import packed_causal_attention
from megatron_rl.ops.precision import compute_dtype
from megatron_rl.ops.zigzag import zigzag_index

# The types that split attention heads over (part of) the CP group.
A2A_COMM_TYPES = ("a2a", "a2a+p2p")


def context_parallel_attention(q, k, v, cu: Sequence[int], group, scale: float, comm_type: str,
                               hierarchy: Optional[tuple] = None):
    """Causal attention of this rank's zigzag shard; ``cu`` are the global padded sequence
    offsets; ``hierarchy`` is ``(a2a group, p2p group)`` for ``a2a+p2p``."""
    cu = tuple(int(c) for c in cu)
    if comm_type == "p2p":
        return RingAttention.apply(q, k, v, cu, group, scale)
    if comm_type == "all_gather":
        return AllGatherAttention.apply(q, k, v, cu, group, scale)
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, cu, group, None, scale)
    if comm_type == "a2a+p2p":
        if hierarchy is None:
            raise ValueError("cp_comm_type=a2a+p2p needs the hierarchical CP groups "
                             "(parallel.hierarchical_context_parallel_sizes)")
        return ulysses_attention(q, k, v, cu, hierarchy[0], hierarchy[1], scale)
    raise ValueError(f"parallel.cp_comm_type={comm_type!r} is not available without TransformerEngine; "
                     f"use one of {CP_COMM_TYPES}")


# ----------------------------------------------------------------------------- block plan


@functools.lru_cache(maxsize=256)
def block_pairs(cu: tuple[int, ...], cp: int, rank: int, src: int) -> tuple:
    """``((q_start, q_end), (k_start, k_end), causal)`` per sequence: the kernel calls rank
    ``rank``'s queries make against rank ``src``'s keys (local token offsets)."""
    pairs = []
    for start, end in zip(cu[:-1], cu[1:]):
        length = end - start
        if length == 0:
            continue
        if length % (2 * cp):
            raise ValueError(f"sequence length {length} is not a multiple of 2*cp={2 * cp}")
        s0, h = start // cp, length // (2 * cp)
        if src == rank:
            pairs.append(((s0, s0 + 2 * h), (s0, s0 + 2 * h), True))
        elif src < rank:
            pairs.append(((s0, s0 + 2 * h), (s0, s0 + h), False))
        else:
            pairs.append(((s0 + h, s0 + 2 * h), (s0, s0 + 2 * h), False))
    return tuple(pairs)


def _rows(x, a, e):
    return x[..., a:e, :]


@dataclasses.dataclass(frozen=True)
class PackedBlocks:
    """One ring step's blocks of packed sequences as one variable-length kernel call: the rows
    of ``q`` and of ``k``/``v`` the blocks use, in block order, and their offsets."""

    q_index: torch.Tensor  # long [total_q]: local query rows
    k_index: torch.Tensor  # long [total_k]: local key rows
    cu_q: torch.Tensor  # int32 [blocks + 1]
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool


@functools.lru_cache(maxsize=32)  # device index tensors: a few steps' layouts, not every batch's
def packed_blocks(pairs: tuple, device: torch.device) -> PackedBlocks:
    """The :class:`PackedBlocks` of ``pairs`` (one ring step: all causal or all full), built on
    the host once per batch layout and step and moved to ``device``."""
    causal = {c for _, _, c in pairs}
    if len(causal) != 1:
        raise ValueError("a ring step's blocks are all causal or all full")

    def index_and_offsets(spans):
        index = torch.cat([torch.arange(a, e) for a, e in spans])
        sizes = torch.tensor([e - a for a, e in spans])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int32), sizes.cumsum(0).to(torch.int32)])
        return index.to(device), offsets.to(device), int(sizes.max())

    q_index, cu_q, max_q = index_and_offsets([q for q, _, _ in pairs])
    k_index, cu_k, max_k = index_and_offsets([k for _, k, _ in pairs])
    return PackedBlocks(q_index, k_index, cu_q, cu_k, max_q, max_k, causal.pop())


def _packed(q, pairs) -> Optional[PackedBlocks]:
    """The step's blocks as one varlen call where a kernel exists for ``q`` and there are
    several packed sequences; None to call the kernel per sequence."""
    if len(pairs) < 2 or q.size(0) != 1 or not attention_kernels.varlen_ready(q):
        return None
    return packed_blocks(pairs, q.device)


def _take(x, index) -> torch.Tensor:
    """Rows ``index`` of ``x`` ``[1, heads, s, d]`` as ``[len(index), heads, d]``."""
    return x[0].index_select(1, index).transpose(0, 1).contiguous()


def _packed_block_forward(q, k, v, blocks: PackedBlocks, scale, acc_out, acc_lse, first: bool) -> None:
    out, lse = attention_kernels.varlen_forward(_take(q, blocks.q_index), _take(k, blocks.k_index),
                                                _take(v, blocks.k_index), blocks.cu_q, blocks.cu_k, blocks.max_q,
                                                blocks.max_k, blocks.causal, scale)
    out = out.transpose(0, 1)  # [heads, total_q, d]
    if first:
        acc_out[0].index_copy_(1, blocks.q_index, out.to(acc_out.dtype))
        acc_lse[0].index_copy_(1, blocks.q_index, lse.to(acc_lse.dtype))
        return
    rows_out = acc_out[0].index_select(1, blocks.q_index)
    rows_lse = acc_lse[0].index_select(1, blocks.q_index)
    merge_into(rows_out, rows_lse, out, lse)
    acc_out[0].index_copy_(1, blocks.q_index, rows_out)
    acc_lse[0].index_copy_(1, blocks.q_index, rows_lse)


def _packed_block_backward(do, q, k, v, out, lse, blocks: PackedBlocks, scale, dq, dkv, d: int) -> None:
    gq, gk, gv = attention_kernels.varlen_backward(
        _take(do, blocks.q_index), _take(q, blocks.q_index), _take(k, blocks.k_index), _take(v, blocks.k_index),
        _take(out, blocks.q_index), lse[0].index_select(1, blocks.q_index), blocks.cu_q, blocks.cu_k,
        blocks.max_q, blocks.max_k, blocks.causal, scale)
    dq[0].index_add_(1, blocks.q_index, gq.transpose(0, 1).to(dq.dtype))
    dkv[0][..., :d].index_add_(1, blocks.k_index, gk.transpose(0, 1).to(dkv.dtype))
    dkv[0][..., d:].index_add_(1, blocks.k_index, gv.transpose(0, 1).to(dkv.dtype))


def _block_forward(q, k, v, pairs, scale, acc_out, acc_lse, first: bool) -> None:
    """Attend ``q`` to one rank's ``k``/``v`` and fold the results into the accumulators; the
    first block (a rank's own keys) covers every query, so it initialises them."""
    blocks = _packed(q, pairs)
    if blocks is not None:
        _packed_block_forward(q, k, v, blocks, scale, acc_out, acc_lse, first)
        return
    for (qa, qe), (ka, ke), causal in pairs:
        out, lse = attention_forward(_rows(q, qa, qe), _rows(k, ka, ke), _rows(v, ka, ke), causal, scale)
        if first:
            acc_out[..., qa:qe, :].copy_(out)
            acc_lse[..., qa:qe].copy_(lse)
        else:
            merge_into(acc_out[..., qa:qe, :], acc_lse[..., qa:qe], out, lse)


def _block_backward(do, q, k, v, out, lse, pairs, scale, dq, dkv, d: int) -> None:
    """Add one key block's share of the gradients to ``dq`` and to the block's ``dkv`` (in place)."""
    blocks = _packed(q, pairs)
    if blocks is not None:
        _packed_block_backward(do, q, k, v, out, lse, blocks, scale, dq, dkv, d)
        return
    for (qa, qe), (ka, ke), causal in pairs:
        gq, gk, gv = attention_backward(_rows(do, qa, qe), _rows(q, qa, qe), _rows(k, ka, ke), _rows(v, ka, ke),
                                        _rows(out, qa, qe), lse[..., qa:qe], causal, scale)
        dq[..., qa:qe, :] += gq
        dkv[..., ka:ke, :d] += gk
        dkv[..., ka:ke, d:] += gv


def _save(ctx, q, k, v, out, lse, cu, group, scale):
    """What both strategies' backward needs: the local inputs, the merged output and lse."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.cu, ctx.group, ctx.scale = cu, group, scale
    return out


def _restore(ctx):
    return (*ctx.saved_tensors, ctx.cu, ctx.group, ctx.scale)


def _accumulators(q):
    """The output accumulator ``[b, heads, s, d]`` laid out sequence-major (``[s, b, heads, d]`` in
    memory), the layout the output projection reads: the output the attention keeps for backward
    and the projection's input are then one tensor, as with one process's SDPA, not two."""
    dtype = compute_dtype(q)
    b, n, s, d = q.shape
    out = torch.empty(s, b, n, d, dtype=dtype, device=q.device).permute(1, 2, 0, 3)
    return out, torch.empty(q.shape[:-1], dtype=dtype, device=q.device)


# ----------------------------------------------------------------------------- ring (p2p)


def _ring_exchange(send: torch.Tensor, group, tag: int) -> tuple[torch.Tensor, list]:
    """Start sending ``send`` to the next rank of ``group`` and receiving the previous rank's."""
    cp, rank = group.size(), group.rank()
    send = send.contiguous()
    recv = torch.empty_like(send)
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prv = dist.get_global_rank(group, (rank - 1) % cp)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, group, scale: float):
        cp, rank = group.size(), group.rank()
        acc_out, acc_lse = _accumulators(q)
        kv = torch.cat([k, v], dim=-1)
        d = k.size(-1)
        for step in range(cp):
            reqs = []
            if step < cp - 1:
                next_kv, reqs = _ring_exchange(kv, group, tag=step)
            src = (rank - step) % cp
            _block_forward(q, kv[..., :d], kv[..., d:], block_pairs(cu, cp, rank, src), scale, acc_out, acc_lse,
                           first=step == 0)
            if step < cp - 1:
                _wait(reqs)
                kv = next_kv
        return _save(ctx, q, k, v, acc_out.to(q.dtype), acc_lse, cu, group, scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, group, scale = _restore(ctx)
        cp, rank, d, dtype = group.size(), group.rank(), k.size(-1), compute_dtype(q)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        dkv_reqs, dkv_in = [], None
        for step in range(cp):
            kv_reqs = []
            if step < cp - 1:
                next_kv, kv_reqs = _ring_exchange(kv, group, tag=2 * step)
            src = (rank - step) % cp
            dkv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
            _block_backward(grad_out, q, kv[..., :d], kv[..., d:], out, lse, block_pairs(cu, cp, rank, src), scale,
                            dq, dkv, d)
            if step > 0:  # what the ranks before this one added to this block's gradient
                _wait(dkv_reqs)
                dkv += dkv_in
            # On to the next rank; after the last step that is the block's owner.
            dkv_in, dkv_reqs = _ring_exchange(dkv, group, tag=2 * step + 1) if cp > 1 else (dkv, [])
            if step < cp - 1:
                _wait(kv_reqs)
                kv = next_kv
        _wait(dkv_reqs)
        return dq.to(q.dtype), dkv_in[..., :d].to(k.dtype), dkv_in[..., d:].to(v.dtype), None, None, None


# ----------------------------------------------------------------------------- all_gather


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather dim 2 of ``[b, n, s, d]`` over ``group``: ``[cp, b, n, s, d]`` in rank order."""
    front = x.unsqueeze(0).contiguous()
    out = front.new_empty((group.size(), *x.shape))
    dist.all_gather_into_tensor(out, front, group=group)
    return out


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``[cp, b, n, s, d]`` over ``group`` and keep this rank's ``[b, n, s, d]``."""
    out = x.new_empty((1, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out[0]


def _own_block_first(cp: int, rank: int) -> list[int]:
    return [rank] + [r for r in range(cp) if r != rank]


class AllGatherAttention(torch.autograd.Function):
    """Gather K/V over the CP group and attend block by block; backward gathers again.

    Keeping the gathered K/V for backward would cost every layer CP times its local K/V; saving
    only the local q, k, v costs one more all-gather per layer in backward and keeps saved
    activations ``O(S/cp)`` like the ring."""

    @staticmethod
    def forward(ctx, q, k, v, cu, group, scale: float):
        cp, rank = group.size(), group.rank()
        d = k.size(-1)
        kv_all = _gather_seq(torch.cat([k, v], dim=-1), group)
        acc_out, acc_lse = _accumulators(q)
        for src in _own_block_first(cp, rank):
            _block_forward(q, kv_all[src, ..., :d], kv_all[src, ..., d:], block_pairs(cu, cp, rank, src), scale,
                           acc_out, acc_lse, first=src == rank)
        del kv_all
        return _save(ctx, q, k, v, acc_out.to(q.dtype), acc_lse, cu, group, scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, group, scale = _restore(ctx)
        cp, rank, d, dtype = group.size(), group.rank(), k.size(-1), compute_dtype(q)
        kv_all = _gather_seq(torch.cat([k, v], dim=-1), group)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dkv_all = torch.zeros(kv_all.shape, dtype=dtype, device=q.device)
        for src in range(cp):
            _block_backward(grad_out, q, kv_all[src, ..., :d], kv_all[src, ..., d:], out, lse,
                            block_pairs(cu, cp, rank, src), scale, dq, dkv_all[src], d)
        del kv_all
        dkv = _reduce_scatter_seq(dkv_all, group)
        return dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype), None, None, None


# ----------------------------------------------------------------------------- a2a (Ulysses)


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, n, s, d]`` sequence shard -> ``[b, n/A, A*s, d]`` head shard, sequence in rank order."""
    a = group.size()
    b, n, s, d = x.shape
    recv = _all_to_all(x.reshape(b, a, n // a, s, d).transpose(0, 1).contiguous(), group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n // a, a * s, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`."""
    a = group.size()
    b, m, total, d = x.shape
    s = total // a
    recv = _all_to_all(x.reshape(b, m, a, s, d).permute(2, 0, 1, 3, 4).contiguous(), group)
    return recv.transpose(0, 1).reshape(b, a * m, s, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


@functools.lru_cache(maxsize=64)
def _global_positions(cu: tuple[int, ...], cp: int, rank: int) -> torch.Tensor:
    """Packed-row positions (sequence offset + position) of a CP rank's local tokens, in order."""
    parts = [start + zigzag_index(end - start, cp, rank) for start, end in zip(cu[:-1], cu[1:]) if end > start]
    return torch.cat(parts)


@functools.lru_cache(maxsize=64)
def a2a_order(cu: tuple[int, ...], cp: int, group_rank: int, a2a: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)``: sorts the a2a group's gathered tokens (rank-major) by position.

    The group's CP ranks ``o*a2a .. o*a2a + a2a-1`` hold, together, the zigzag halves ``o`` and
    ``2P-1-o`` of a ring of ``P = cp/a2a`` members, so position order is that ring's local layout
    (with ``P = 1``, the natural order)."""
    first = group_rank * a2a
    held = torch.cat([_global_positions(cu, cp, first + a) for a in range(a2a)])
    order = torch.argsort(held)
    return order, torch.argsort(order)


def kv_replication(kv_heads: int, a2a: int) -> int:
    """How many times a2a repeats each K/V head so every rank of the group gets whole heads."""
    if kv_heads % a2a == 0:
        return 1
    if a2a % kv_heads == 0:
        return a2a // kv_heads
    raise ValueError(f"a2a context parallelism over {a2a} ranks needs kv_heads ({kv_heads}) divisible by {a2a}, "
                     f"or {a2a} divisible by kv_heads")


def ulysses_attention(q, k, v, cu: tuple[int, ...], a2a_group, ring_group, scale: float):
    """a2a (``ring_group`` None) or a2a+p2p attention of this rank's zigzag shard."""
    a2a = a2a_group.size()
    rings = ring_group.size() if ring_group is not None else 1
    cp = a2a * rings
    if q.size(1) % a2a:
        raise ValueError(f"a2a context parallelism needs the heads per rank ({q.size(1)}) divisible by {a2a}")
    repeat = kv_replication(k.size(1), a2a)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    outer = ring_group.rank() if ring_group is not None else 0
    order, inverse = (t.to(q.device) for t in a2a_order(cu, cp, outer, a2a))
    qh, kh, vh = (_SeqToHeads.apply(x, a2a_group).index_select(2, order) for x in (q, k, v))
    if ring_group is not None:
        out = RingAttention.apply(qh, kh, vh, cu, ring_group, scale)
    elif len(cu) == 2:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=qh.size(1) != kh.size(1))
    else:
        out = packed_causal_attention(qh, kh, vh, cu, scale)
    return _HeadsToSeq.apply(out.index_select(2, inverse), a2a_group)
