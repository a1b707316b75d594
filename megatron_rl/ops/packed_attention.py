"""Causal attention over a packed (THD) row without one kernel call per sequence.

A packed row holds many sequences back to back; no token may see another sequence.  On CUDA
with bfloat16/float16, torch's variable-length flash kernel (``torch.nn.attention.varlen``) does
it in one call.  Elsewhere there is no varlen kernel, so sequences are grouped into *buckets* of
similar length, each bucket gathered into a padded ``[sequences, heads, length, dim]`` batch for
one fused causal SDPA call, and the valid rows scattered back.  Padding sits at the end of each
sequence, so under the causal mask a real token never sees it; padded rows are dropped, so they
get no gradient.  A bucket may waste at most :data:`MAX_PADDING_WASTE` of its attention work on
padding beyond what another kernel call would cost (:data:`CALL_COST_ELEMENTS`): short or equal
lengths (the usual RL micro-batch) give one call, very different long lengths one call each.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Most extra attention work (padded score elements / real ones) a bucket may add...
MAX_PADDING_WASTE = 0.3
# ...beyond what one more kernel call costs, in score elements: short sequences share a call
# whatever their lengths, since launching and gathering costs more than their padding.
CALL_COST_ELEMENTS = 1 << 16


def _buckets(lengths: tuple[int, ...]) -> list[list[int]]:
    """Sequence indices grouped so each group's padded work stays within the waste bound."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            group = groups[-1]
            longest = lengths[group[0]]
            real = sum(lengths[j] ** 2 for j in group) + lengths[i] ** 2
            if (len(group) + 1) * longest**2 - real <= MAX_PADDING_WASTE * real + CALL_COST_ELEMENTS:
                group.append(i)
                continue
        groups.append([i])
    return groups


@functools.lru_cache(maxsize=64)
def _plan(cu: tuple[int, ...]):
    """Per bucket: (gather index [n*L], padded length, valid rows of the padded batch); and the
    permutation from bucket order back to packed order."""
    starts, lengths = cu[:-1], tuple(e - s for s, e in zip(cu[:-1], cu[1:]))
    buckets, order = [], []
    for group in _buckets(lengths):
        longest = lengths[group[0]]
        steps = torch.arange(longest)
        gather = torch.cat([starts[i] + steps.clamp(max=lengths[i] - 1) for i in group])
        valid = torch.cat([j * longest + torch.arange(lengths[i]) for j, i in enumerate(group)])
        buckets.append((gather, longest, len(group), valid))
        order.extend(starts[i] + t for i in group for t in range(lengths[i]))
    inverse = torch.argsort(torch.tensor(order))
    return tuple(buckets), inverse


def _on(t: torch.Tensor, device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def packed_causal_attention(q, k, v, cu: tuple[int, ...], scale: float) -> torch.Tensor:
    """``[1, heads, t, d]`` causal attention where ``cu`` are the packed (padded) sequence offsets."""
    cu = tuple(int(c) for c in cu)
    gqa = q.size(1) != k.size(1)
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        return _varlen_cuda(q, k, v, cu, scale, gqa)
    buckets, inverse = _plan(cu)
    if len(buckets) == 1 and buckets[0][2] == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    pieces = []
    for gather, longest, count, valid in buckets:
        gather, valid = _on(gather, q.device), _on(valid, q.device)

        def batch(x):  # [1, n, t, d] -> [count, n, longest, d]
            n, d = x.size(1), x.size(-1)
            return x[0].index_select(1, gather).view(n, count, longest, d).transpose(0, 1)

        out = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        n, d = out.size(1), out.size(-1)
        pieces.append(out.transpose(0, 1).reshape(n, count * longest, d).index_select(1, valid))
    return torch.cat(pieces, dim=1).index_select(1, _on(inverse, q.device)).unsqueeze(0)


def _varlen_cuda(q, k, v, cu, scale, gqa):
    """One variable-length flash call (CUDA, half precision)."""
    from megatron_rl.ops.torch_varlen import causal_varlen_attention

    offsets = torch.tensor(cu, dtype=torch.int32).pin_memory().to(q.device, non_blocking=True)
    longest = max(e - s for s, e in zip(cu[:-1], cu[1:]))
    out = causal_varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), offsets,
                                  longest, scale)
    return out.transpose(0, 1).unsqueeze(0)
