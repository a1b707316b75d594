"""Context-parallel causal attention without TransformerEngine.

Every rank holds a zigzag shard of the queries, keys and values (see :mod:`megatron_rl.ops.zigzag`)
and a ``positions_of(rank) -> (positions, segment_ids)`` function that says which global positions any
rank holds.  A key is visible to a query when both belong to the same sequence (segment) and the
key's position is not after the query's, so packed and unpacked batches share one code path.

Two strategies:

``all_gather``
    Gather K/V from the whole CP group and run one masked attention; backward gathers again,
    recomputes, and reduce-scatters the K/V gradients.  Saved activations stay O(S/CP); the
    transient gathered K/V and the ``[S/CP, S]`` mask of one layer grow with the full length.
``p2p``
    Ring attention: K/V blocks travel around the CP ring while each rank merges block results
    with an online softmax.  Its own backward recomputes each block and sends the K/V gradients
    around the ring back to their owners, so saved activations stay O(S/CP).

Shapes: ``q`` is ``[b, heads, sq, d]``, ``k``/``v`` are ``[b, kv_heads, sk, d]`` (GQA allowed).

Nothing in the per-layer loop reads a value back from the device: which query tiles of a ring
step see any key is decided on the host from the (host) positions, once per micro-batch, and the
positions reach the device once per micro-batch; every layer reuses both (:data:`_MASKS`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.ops.precision import compute_dtype
from megatron_rl.ops.zigzag import to_device

PositionFn = Callable[[int], "tuple[torch.Tensor, torch.Tensor]"]

CP_COMM_TYPES = ("p2p", "all_gather")


def context_parallel_attention(q, k, v, positions_of: PositionFn, group, scale: float, comm_type: str):
    if comm_type == "all_gather":
        return AllGatherAttention.apply(q, k, v, positions_of, group, scale)
    if comm_type == "p2p":
        return RingAttention.apply(q, k, v, positions_of, group, scale)
    raise ValueError(
        f"parallel.cp_comm_type={comm_type!r} is not available without TransformerEngine; "
        f"use one of {CP_COMM_TYPES}"
    )


def visibility_mask(pos_q, seg_q, pos_k, seg_k) -> torch.Tensor:
    """``[sq, sk]`` bool: True where the query may attend to the key."""
    return (seg_q[:, None] == seg_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])


# ----------------------------------------------------------------------------- all_gather


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather dim 2 of ``[b, n, s, d]`` over ``group``, in rank order."""
    front = x.permute(2, 0, 1, 3).contiguous()
    out = front.new_empty((group.size() * front.size(0), *front.shape[1:]))
    dist.all_gather_into_tensor(out, front, group=group)
    return out.permute(1, 2, 0, 3)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``[b, n, S, d]`` over ``group`` and keep this rank's ``S / cp`` slice of dim 2."""
    front = x.permute(2, 0, 1, 3).contiguous()
    out = front.new_empty((front.size(0) // group.size(), *front.shape[1:]))
    dist.reduce_scatter_tensor(out, front, group=group)
    return out.permute(1, 2, 0, 3)


# What one micro-batch's layers share, keyed by the identity of its (cached) position tensors:
# the all_gather additive masks and the ring's plans.  Cleared between test bodies.
_MASKS: dict = {}
_MAX_ENTRIES = 8


def _remember(key, value, held):
    """Cache ``value``; holding the position tensors keeps their ids from being reused."""
    if len(_MASKS) > _MAX_ENTRIES:
        _MASKS.clear()
    _MASKS[key] = (value, held)
    return value


def _additive_mask(positions_of: PositionFn, cp: int, rank: int, dtype, device) -> torch.Tensor:
    """``[local, full]`` additive mask (0 / -inf), one tensor per position function shared by all layers.

    SDPA keeps the mask it is given for backward; handing every layer the same tensor keeps one
    copy instead of one per layer.  The position functions return cached tensors, whose identity
    keys this cache."""
    pos_q, seg_q = positions_of(rank)
    per_rank = [positions_of(r) for r in range(cp)]
    key = (id(pos_q), id(seg_q), tuple(id(p) for p, _ in per_rank), dtype, str(device))
    entry = _MASKS.get(key)
    mask = entry[0] if entry is not None else None
    if mask is None:
        pos_k = torch.cat([p for p, _ in per_rank])
        seg_k = torch.cat([s for _, s in per_rank])
        visible = visibility_mask(pos_q, seg_q, pos_k, seg_k).to(device)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        _remember(key, mask, (pos_q, seg_q, per_rank))
    return mask


def _masked_attention(q, k_all, v_all, positions_of: PositionFn, group, scale):
    mask = _additive_mask(positions_of, group.size(), group.rank(), q.dtype, q.device)
    return F.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=q.size(1) != k_all.size(1)
    )


class AllGatherAttention(torch.autograd.Function):
    """Gather K/V over the CP group and attend; backward gathers again and recomputes.

    Keeping the gathered K/V for backward would cost every layer CP times its local K/V -- at
    32k tokens and CP=4 most of the activation memory.  Saving only the local q, k, v costs one
    more all-gather and attention forward per layer in backward, and keeps saved activations
    O(S/CP) like the ring."""

    @staticmethod
    def forward(ctx, q, k, v, positions_of: PositionFn, group, scale: float):
        out = _masked_attention(q, _gather_seq(k, group), _gather_seq(v, group), positions_of, group, scale)
        ctx.save_for_backward(q, k, v)
        ctx.positions_of, ctx.group, ctx.scale = positions_of, group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        group = ctx.group
        k_all, v_all = _gather_seq(k, group), _gather_seq(v, group)
        with torch.enable_grad():
            q, k_all, v_all = (t.detach().requires_grad_() for t in (q, k_all, v_all))
            out = _masked_attention(q, k_all, v_all, ctx.positions_of, group, ctx.scale)
            dq, dk_all, dv_all = torch.autograd.grad(out, (q, k_all, v_all), grad_out)
        return dq, _reduce_scatter_seq(dk_all, group), _reduce_scatter_seq(dv_all, group), None, None, None


# ----------------------------------------------------------------------------- ring (p2p)


def _group_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, n, s, d = q.shape
    return q.reshape(b, kv_heads, n // kv_heads, s, d)


def _ring_exchange(send: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Start sending ``send`` to the next CP rank and receiving the previous rank's tensor."""
    cp, rank = group.size(), group.rank()
    send = send.contiguous()
    recv = torch.empty_like(send)
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prv = dist.get_global_rank(group, (rank - 1) % cp)
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


# Largest score block (elements) one query tile may create per ring step: the transient
# [b, heads, tile, S/cp] fp32 scores stay near 64 MiB however long the sequence is.
_MAX_BLOCK_ELEMENTS = 1 << 24


def _query_tiles(qf: torch.Tensor, sk: int):
    """Query ranges ``(start, end)`` so one tile's score block stays under the cap."""
    b, h, g, sq, _ = qf.shape
    tile = max(16, min(sq, _MAX_BLOCK_ELEMENTS // max(1, b * h * g * sk)))
    return tuple((a, min(sq, a + tile)) for a in range(0, sq, tile))


def _visible_tiles(pos_q, seg_q, pos_k, seg_k, tiles) -> tuple:
    """The query tiles that see at least one key of a block, from host positions.

    A query sees a key of its own sequence at or before it, so it sees some key of the block when
    its position reaches the block's first key of that sequence."""
    segments = int(torch.maximum(seg_q.max(), seg_k.max())) + 1
    first = torch.full((segments,), torch.iinfo(pos_k.dtype).max, dtype=pos_k.dtype)
    first.scatter_reduce_(0, seg_k, pos_k, reduce="amin")
    sees = (pos_q >= first[seg_q]).long()
    seen_before = [0] + sees.cumsum(0).tolist()
    return tuple((a, e) for a, e in tiles if seen_before[e] > seen_before[a])


@dataclasses.dataclass(frozen=True)
class _RingPlan:
    """One rank's ring for one micro-batch: its positions on the device, and per source rank the
    key positions on the device and the query tiles that see any of those keys."""

    q: tuple
    k: tuple  # per source rank: (positions, segments) on the device
    tiles: tuple  # per source rank: ((start, end), ...)


def _ring_plan(positions_of: PositionFn, cp: int, rank: int, tiles: tuple, device) -> _RingPlan:
    per_rank = [positions_of(r) for r in range(cp)]
    key = ("ring", rank, tiles, str(device), tuple(id(t) for pair in per_rank for t in pair))
    entry = _MASKS.get(key)
    if entry is not None:
        return entry[0]
    pos_q, seg_q = per_rank[rank]
    plan = _RingPlan(
        q=(to_device(pos_q, device), to_device(seg_q, device)),
        k=tuple((to_device(p, device), to_device(sg, device)) for p, sg in per_rank),
        tiles=tuple(_visible_tiles(pos_q, seg_q, p, sg, tiles) for p, sg in per_rank),
    )
    return _remember(key, plan, per_rank)


def _tile_mask(plan: _RingPlan, src: int, a: int, e: int) -> torch.Tensor:
    pos_q, seg_q = plan.q
    return visibility_mask(pos_q[a:e], seg_q[a:e], *plan.k[src])


def _block_forward(qf, kb, vb, plan: _RingPlan, src: int, scale, acc_o, acc_m, acc_l) -> None:
    """Merge one K/V block into the running (output, max, sum) of each query tile, in place."""
    for a, e in plan.tiles[src]:
        tile_mask = _tile_mask(plan, src, a, e)
        s = torch.einsum("bhgqd,bhkd->bhgqk", qf[..., a:e, :], kb) * scale
        s = s.masked_fill(~tile_mask, float("-inf"))
        m_old = acc_m[..., a:e]
        new_m = torch.maximum(m_old, s.amax(-1))
        safe_m = torch.where(torch.isinf(new_m), torch.zeros_like(new_m), new_m)
        p = torch.exp(s - safe_m[..., None])
        alpha = torch.exp(m_old - safe_m)
        acc_l[..., a:e] = acc_l[..., a:e] * alpha + p.sum(-1)
        acc_o[..., a:e, :] = acc_o[..., a:e, :] * alpha[..., None] + torch.einsum("bhgqk,bhkd->bhgqd", p, vb)
        acc_m[..., a:e] = new_m


def _block_backward(qf, do, delta, lse, kb, vb, plan: _RingPlan, src: int, scale, dq, dkv, d: int) -> None:
    """Add one K/V block's contribution to dq (in place) and to the block's dk/dv (in dkv)."""
    for a, e in plan.tiles[src]:
        tile_mask = _tile_mask(plan, src, a, e)
        q_t, do_t = qf[..., a:e, :], do[..., a:e, :]
        s = torch.einsum("bhgqd,bhkd->bhgqk", q_t, kb) * scale
        s = s.masked_fill(~tile_mask, float("-inf"))
        p = torch.exp(s - lse[..., a:e, None])
        dkv[..., d:] += torch.einsum("bhgqk,bhgqd->bhkd", p, do_t)
        dp = torch.einsum("bhgqd,bhkd->bhgqk", do_t, vb)
        ds = p * (dp - delta[..., a:e, None])
        dq[..., a:e, :] += torch.einsum("bhgqk,bhkd->bhgqd", ds, kb) * scale
        dkv[..., :d] += torch.einsum("bhgqk,bhgqd->bhkd", ds, q_t) * scale


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions_of: PositionFn, group, scale: float):
        cp, rank = group.size(), group.rank()
        kv_heads, d = k.size(1), k.size(-1)
        dtype = compute_dtype(q)
        qf = _group_heads(q.to(dtype), kv_heads)  # [b, h, g, sq, d]
        plan = _ring_plan(positions_of, cp, rank, _query_tiles(qf, k.size(2)), q.device)

        acc_o = torch.zeros_like(qf)
        acc_m = torch.full(qf.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        acc_l = torch.zeros(qf.shape[:-1], dtype=dtype, device=q.device)
        kv = torch.cat([k, v], dim=-1).contiguous()
        for step in range(cp):
            reqs = []
            if step < cp - 1:
                next_kv, reqs = _ring_exchange(kv, group)
            src = (rank - step) % cp
            if plan.tiles[src]:
                _block_forward(qf, kv[..., :d].to(dtype), kv[..., d:].to(dtype), plan, src, scale, acc_o, acc_m, acc_l)
            if step < cp - 1:
                _wait(reqs)
                kv = next_kv
        out = acc_o / acc_l[..., None]
        lse = acc_m + torch.log(acc_l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions_of, ctx.group, ctx.scale = positions_of, group, scale
        b, n, sq, _ = q.shape
        return out.reshape(b, n, sq, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        positions_of, group, scale = ctx.positions_of, ctx.group, ctx.scale
        cp, rank = group.size(), group.rank()
        kv_heads, d = k.size(1), k.size(-1)
        dtype = compute_dtype(q)
        qf = _group_heads(q.to(dtype), kv_heads)
        do = _group_heads(grad_out.to(dtype), kv_heads)
        delta = (do * out).sum(-1)  # [b, h, g, sq]
        plan = _ring_plan(positions_of, cp, rank, _query_tiles(qf, k.size(2)), q.device)

        dq = torch.zeros_like(qf)
        kv = torch.cat([k, v], dim=-1).contiguous()
        dkv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
        for step in range(cp):
            src = (rank - step) % cp
            if plan.tiles[src]:
                _block_backward(qf, do, delta, lse, kv[..., :d].to(dtype), kv[..., d:].to(dtype), plan, src, scale,
                                dq, dkv, d)
            # Pass the block and its accumulated gradient on; after cp sends it is home again.
            if step < cp - 1:
                both = torch.cat([kv.to(dtype), dkv], dim=-1)
                recv, reqs = _ring_exchange(both, group)
                _wait(reqs)
                kv = recv[..., : 2 * d].to(k.dtype)
                dkv = recv[..., 2 * d :]
            else:
                dkv, reqs = _ring_exchange(dkv, group)
                _wait(reqs)
        b, n, sq, _ = q.shape
        dq = dq.reshape(b, n, sq, d).to(q.dtype)
        return dq, dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype), None, None, None
