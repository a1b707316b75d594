"""The record of :mod:`megatron_rl.ops.torch_varlen`, torch's variable-length flash attention
called with the keywords the installed release takes (the adapter lives beside its caller in
``ops/``, which compat may import but not the reverse)."""

from __future__ import annotations

from megatron_rl.compat.records import MEGATRON_TESTED, Workaround, register_workaround

register_workaround(Workaround(
    "torch_varlen.keywords_by_signature", MEGATRON_TESTED,
    "torch.nn.attention.varlen.varlen_attn takes no enable_gqa in torch 2.11 (earlier: is_causal, no "
    "scale) and window_size / scale / enable_gqa in torch 2.13: the call is built from the installed signature",
    "ops/torch_varlen.py:causal_varlen_attention", torch_versions=">=2.10",
))
