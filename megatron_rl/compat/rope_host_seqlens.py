"""Megatron's unfused THD RoPE without reading ``cu_seqlens`` back from the device.

megatron-core 0.19.2 ``rope_utils._apply_rotary_pos_emb_thd`` (used whenever
``apply_rope_fusion`` is off, i.e. without TransformerEngine) calls ``cu_seqlens.tolist()``,
``cu_seqlens[-1].item()`` and, with packed frequencies, ``cu_seqlens[i].item()`` per sequence, for
query and key in every layer: device reads per layer, each a sync on GPU.  Our micro-batches attach the host values to the ``cu_seqlens``
they send (:func:`megatron_rl.ops.zigzag.with_host_values`); this replacement reads them there
and otherwise computes exactly what megatron's function computes (same splits, same frequency
slices, same ``_apply_rotary_pos_emb_bshd``).  Tensors without host values fall back to one read.
"""

from __future__ import annotations

import torch

from megatron_rl.compat.registry import MEGATRON_TESTED, Patch, register_patch


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
    seqlens = [(end - start) // cp_size for start, end in zip(cu[:-1], cu[1:])]
    pieces = torch.split(t, seqlens)
    # freqs covering every packed position: offsets per sequence; otherwise positions restart.
    exact = freqs.dim() >= 1 and freqs.size(0) == cu[-1]
    freqs_packed = torch.cat([
        rope_utils._get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs, cu[i] if exact else 0)
        for i, x in enumerate(pieces)
    ])
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs_packed, rotary_interleaved=rotary_interleaved,
        mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale,
    ).squeeze(1)


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
