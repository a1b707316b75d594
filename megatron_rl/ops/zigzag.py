"""The zigzag context-parallel layout.

A sequence of length ``L`` (a multiple of ``2*cp``) is cut into ``2*cp`` equal chunks; rank ``r``
keeps chunks ``r`` and ``2*cp-1-r``.  Causal attention work is then the same on every rank.
These helpers work on host tensors so a rank can take its shard *before* moving data to its
device.

Host copies travel with the device tensors they describe (:func:`with_host_values`): the packed
``cu_seqlens`` a micro-batch sends to its device carry their values as Python ints, so attention
and RoPE read offsets in every layer without asking the device (a sync per read on GPU).
"""

from __future__ import annotations

from typing import Sequence

import torch

_HOST_VALUES = "_megatron_rl_host_values"


def zigzag_index(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions (ascending) held by ``cp_rank``; ``seq_len`` must divide by ``2*cp``."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2*cp={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk)
    return torch.cat([first, second])


def shard(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = -1) -> torch.Tensor:
    """This rank's zigzag shard of ``x`` along ``dim``."""
    if cp_size == 1:
        return x
    idx = zigzag_index(x.size(dim), cp_size, cp_rank).to(x.device)
    return x.index_select(dim, idx)


def unshard(shards: Sequence[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`shard`: ``shards[r]`` is rank r's shard; returns natural order."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    seq_len = sum(s.size(dim) for s in shards)
    out_shape = list(shards[0].shape)
    out_shape[dim] = seq_len
    out = shards[0].new_empty(out_shape)
    for rank, piece in enumerate(shards):
        out.index_copy_(dim % out.dim(), zigzag_index(seq_len, cp_size, rank).to(out.device), piece)
    return out


def with_host_values(t: torch.Tensor, values: Sequence[int]) -> torch.Tensor:
    """Attach the host-side values of a small integer tensor to it (returns ``t``)."""
    setattr(t, _HOST_VALUES, tuple(int(v) for v in values))
    return t


def host_values(t: torch.Tensor) -> tuple[int, ...]:
    """The values of a small integer tensor, from its host copy when it carries one (no device
    read); otherwise read back once."""
    values = getattr(t, _HOST_VALUES, None)
    return values if values is not None else tuple(int(v) for v in t.tolist())


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device``; to CUDA through pinned memory, so the copy is
    asynchronous rather than a synchronous pageable transfer."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
