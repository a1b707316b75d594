"""Core attention for the local (non-TransformerEngine) layer spec.

Replaces megatron-core's ``DotProductAttention`` (same constructor and forward signature), which
refuses context parallelism and packed sequences.  It handles:

* BSHD input (``[s, b, heads, dim]``) and packed THD input (``[t, heads, dim]`` with
  ``PackedSeqParams``), never attending across sequence boundaries;
* context parallelism with the zigzag layout, through :mod:`megatron_rl.ops.cp_attention`
  (``p2p`` ring, ``all_gather``, ``a2a`` and ``a2a+p2p``), on fused kernels;
* packed rows at CP=1 through :mod:`megatron_rl.ops.packed_attention` (no per-sequence loop);
* queries that continue cached keys (megatron-core's static-batching inference context), causal
  from the end of the keys, or under the boolean ``attention_mask`` megatron passes (True where a
  query may not see a key: left-padded rows of different prompt lengths);
* GQA without materialising repeated K/V heads.

Dropout inside attention is not supported: RL needs deterministic log-probs, so the model
builder sets ``attention_dropout=0``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.distributed.runtime import active_groups
from megatron_rl.ops import cp_attention
from megatron_rl.ops.packed_attention import packed_causal_attention
from megatron_rl.ops.zigzag import host_values


class LocalCoreAttention(MegatronModule):
    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"LocalCoreAttention supports causal attention only, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("model attention dropout must be 0 for RL (deterministic log-probs)")
        self.layer_number = layer_number
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        if config.softmax_scale is not None and softmax_scale is None:
            self.softmax_scale = config.softmax_scale
        self.cp_comm_type = cp_comm_type or getattr(config, "cp_comm_type", None) or "p2p"
        if pg_collection is not None and hasattr(pg_collection, "cp"):
            self.cp_group = pg_collection.cp
        else:
            self.cp_group = getattr(active_groups(), "cp", None)

    def _hierarchy(self):
        """``(a2a group, p2p group)`` for ``a2a+p2p``: megatron's hierarchical CP groups, inner first."""
        if self.cp_comm_type != "a2a+p2p":
            return None
        groups = getattr(active_groups(), "hcp", None)
        return tuple(groups) if groups else None

    def _cp(self) -> tuple[int, int]:
        if self.cp_group is None:
            return 1, 0
        return self.cp_group.size(), self.cp_group.rank()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by LocalCoreAttention")
        cp_size, _ = self._cp()
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:
            # [t, n, d] -> [1, n, t, d]
            q, k, v = (x.unsqueeze(0).transpose(1, 2) for x in (query, key, value))
        else:
            # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))

        if attention_mask is not None:
            if packed or cp_size > 1:
                raise NotImplementedError("LocalCoreAttention takes an attention mask on unpacked rows at CP=1 only")
            # megatron's convention: True where a query may not see a key
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
                                                 enable_gqa=q.size(1) != k.size(1))
        elif cp_size == 1 and not packed and q.size(2) != k.size(2):
            out = _attention_to_cached_keys(q, k, v, self.softmax_scale)
        elif cp_size == 1 and not packed:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1)
            )
        elif cp_size == 1:
            out = packed_causal_attention(q, k, v, _padded_cu_seqlens(packed_seq_params), self.softmax_scale)
        else:
            # The sequences' global padded offsets: a packed row's, or one sequence per unpacked row.
            cu = _padded_cu_seqlens(packed_seq_params) if packed else (0, q.size(2) * cp_size)
            out = cp_attention.context_parallel_attention(
                q, k, v, cu, self.cp_group, self.softmax_scale, self.cp_comm_type, self._hierarchy()
            )

        if packed:
            # [1, n, t, d] -> [t, n*d]
            return out.squeeze(0).transpose(0, 1).reshape(out.size(2), -1)
        # [b, n, s, d] -> [s, b, n*d]
        b, n, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _attention_to_cached_keys(q, k, v, scale: float) -> torch.Tensor:
    """Queries that are the last ``sq`` positions of ``sk`` keys: megatron-core's static-batching
    inference (``StaticInferenceContext``) hands the layer the cached keys and values with each
    step's new tokens.  Causal alignment is to the end of the keys (bottom right), not the start
    as ``is_causal`` would take it; one new token sees every key."""
    gqa = q.size(1) != k.size(1)
    if q.size(2) == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.size(2), k.size(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _padded_cu_seqlens(params: PackedSeqParams) -> tuple[int, ...]:
    """The padded offsets from the host copy the micro-batch attached (no device read per layer)."""
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return host_values(cu)

