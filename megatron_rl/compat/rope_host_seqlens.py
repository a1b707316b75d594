"""Megatron's unfused THD RoPE without reading ``cu_seqlens`` back from the device.

megatron-core 0.19.2 ``rope_utils._apply_rotary_pos_emb_thd`` (used whenever ``apply_rope_fusion``
is off, i.e. without TransformerEngine) calls ``cu_seqlens.tolist()``, ``cu_seqlens[-1].item()``
and, with packed frequencies, ``cu_seqlens[i].item()`` per sequence, for query and key in every
layer: device reads per layer, each a sync on GPU.  Our micro-batches attach the host values to the
``cu_seqlens`` they send (:func:`megatron_rl.ops.zigzag.with_host_values`); this replacement reads
them there and otherwise computes exactly what megatron's function computes (same splits, same
frequency slices, same ``_apply_rotary_pos_emb_bshd``).  Tensors without host values fall back to
one read.

megatron gathers each sequence's frequencies with its own slice (two per sequence under CP) and a
``torch.cat``, a Python loop over the sequences of the micro-batch for q and k in every layer.  The
same positions are gathered here with one index, built once per micro-batch layout and cached: a
128-sequence micro-batch goes from about 260 small ops per RoPE call to one.
"""

from __future__ import annotations

import functools

import torch

from megatron_rl.compat.records import MEGATRON_TESTED, Patch, register_patch


def _apply_rotary_pos_emb_thd_host(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    mla_rotary_interleaved: bool = False,
    mscale: float = 1.0,
    cp_group=None,
    multi_latent_attention: bool | None = None,
) -> torch.Tensor:
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.ops.zigzag import host_values

    if multi_latent_attention is not None:  # megatron's deprecated name for the same switch
        mla_rotary_interleaved = multi_latent_attention
    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cu = host_values(cu_seqlens)
    # freqs covering every packed position: offsets per sequence; otherwise positions restart.
    exact = freqs.dim() >= 1 and freqs.size(0) == cu[-1]
    index, last = _frequency_rows(cu, cp_size, cp_rank, exact, freqs.device)
    if index.numel() != t.size(0):
        raise ValueError(f"THD RoPE: {t.size(0)} tokens on this rank, but cu_seqlens {cu} with CP {cp_size} "
                         f"give {index.numel()}")
    if last >= freqs.size(0):
        raise ValueError(f"THD RoPE: position {last} is past the {freqs.size(0)} rotary frequencies")
    freqs_packed = freqs[index]
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs_packed, rotary_interleaved=rotary_interleaved,
        mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale,
    ).squeeze(1)


@functools.lru_cache(maxsize=64)
def _frequency_rows(cu: tuple[int, ...], cp_size: int, cp_rank: int, exact: bool,
                    device: torch.device) -> tuple[torch.Tensor, int]:
    """The row of ``freqs`` for every token this CP rank holds, in packed order: what megatron's
    ``_get_thd_freqs_on_this_cp_rank`` slices sequence by sequence.  Without CP, sequence ``i``
    covers positions ``0..L-1`` (plus its packed offset with exact frequencies); with CP each rank
    holds two halves of a zigzag split: chunk ``cp_rank`` and chunk ``2*cp_size-1-cp_rank``.
    Returns the index on ``device`` (built once per layout, not per layer) and its largest row."""
    ranges = []  # (first, stop) of each run of consecutive rows
    for start, end in zip(cu[:-1], cu[1:]):
        offset = start if exact else 0
        local = (end - start) // cp_size
        if cp_size > 1:
            seg, full = local // 2, cp_size * local
            ranges.append((offset + cp_rank * seg, offset + (cp_rank + 1) * seg))
            ranges.append((offset + full - (cp_rank + 1) * seg, offset + full - cp_rank * seg))
        else:
            ranges.append((offset, offset + local))
    index = torch.cat([torch.arange(a, b) for a, b in ranges]) if ranges else torch.zeros(0, dtype=torch.long)
    last = max((b - 1 for a, b in ranges if b > a), default=-1)
    return index.to(device), last


def _patch_rope_thd() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils._apply_rotary_pos_emb_thd = _apply_rotary_pos_emb_thd_host


register_patch(
    Patch(
        name="rope.thd_host_cu_seqlens",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "rope_utils._apply_rotary_pos_emb_thd (unfused THD RoPE) reads cu_seqlens back with "
            ".tolist() and a tensor comparison for q and k in every layer, a device sync each on "
            "GPU; the replacement reads the host values our micro-batches attach"
        ),
        apply=_patch_rope_thd,
    )
)
