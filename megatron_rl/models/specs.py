"""Layer specs: TransformerEngine's on GPU, the local spec (our norms and attention) elsewhere.

``model.transformer_impl=auto`` picks TransformerEngine when it imports and CUDA is present.
The local spec swaps two modules into megatron-core's own local layer spec, through
``ModuleSpec`` rather than a fork: :class:`~megatron_rl.models.norms.LocalNorm` (sequence-parallel
aware) and :class:`~megatron_rl.models.core_attention.LocalCoreAttention` (context parallel,
packed sequences).
"""

from __future__ import annotations

import copy

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.models.core_attention import LocalCoreAttention
from megatron_rl.models.norms import LocalNorm


def local_layer_spec(config: TransformerConfig) -> ModuleSpec:
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=config.qk_layernorm, normalization=config.normalization
    )
    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.input_layernorm = LocalNorm
    sub.pre_mlp_layernorm = LocalNorm
    attn = sub.self_attention.submodules
    attn.core_attention = LocalCoreAttention
    if config.qk_layernorm:
        attn.q_layernorm = LocalNorm
        attn.k_layernorm = LocalNorm
    return spec


def te_layer_spec(config: TransformerConfig) -> ModuleSpec:  # pragma: no cover - needs TE + CUDA
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)


def block_spec(config: TransformerConfig, impl: str, vp_stage: int | None) -> TransformerBlockSubmodules:
    """The decoder block for this pipeline stage (and virtual stage)."""
    if impl == "transformer_engine":  # pragma: no cover - needs TE + CUDA
        from megatron.core.extensions.transformer_engine import TENorm

        layer, final_norm = te_layer_spec(config), TENorm
    else:
        layer, final_norm = local_layer_spec(config), LocalNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm)
