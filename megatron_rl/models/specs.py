"""Layer specs: TransformerEngine's on GPU, the local spec (our norms and attention) elsewhere.

``model.transformer_impl=auto`` picks TransformerEngine when it imports and CUDA is present.
The local spec swaps two modules into megatron-core's own local layer spec, through
``ModuleSpec`` rather than a fork: :class:`~megatron_rl.models.norms.LocalNorm` (sequence-parallel
aware) and :class:`~megatron_rl.models.core_attention.LocalCoreAttention` (context parallel,
packed sequences).  MoE layers (``model.moe``) take megatron's MoE spec -- ``SequentialMLP``
experts on the local spec, grouped-GEMM experts on the TE spec -- with our router
(:class:`~megatron_rl.models.moe.RLTopKRouter`) in ``MoESubmodules.router``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_rl.models.core_attention import LocalCoreAttention
from megatron_rl.models.norms import LocalNorm


def with_router(spec: ModuleSpec, router) -> ModuleSpec:
    """``spec`` (a layer spec whose MLP is megatron's MoE layer) with ``router`` as the router class.

    megatron-core 0.19.2 builds the MoE module spec as ``functools.partial(MoELayer,
    submodules=MoESubmodules(...))`` (``models/gpt/moe_module_specs.py``), no longer a
    ``ModuleSpec``; the router is the ``router`` field of those submodules."""
    spec = copy.deepcopy(spec)
    mlp = spec.submodules.mlp
    if isinstance(mlp, functools.partial):
        submodules = dataclasses.replace(mlp.keywords["submodules"], router=router)
        spec.submodules.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    else:
        mlp.submodules.router = router
    return spec


def local_layer_spec(config: TransformerConfig, moe: bool = False, router=None) -> ModuleSpec:
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts if moe else None, moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm, normalization=config.normalization
    )
    spec = with_router(spec, router) if moe and router is not None else copy.deepcopy(spec)
    sub = spec.submodules
    sub.input_layernorm = LocalNorm
    sub.pre_mlp_layernorm = LocalNorm
    attn = sub.self_attention.submodules
    attn.core_attention = LocalCoreAttention
    if config.qk_layernorm:
        attn.q_layernorm = LocalNorm
        attn.k_layernorm = LocalNorm
    return spec


def te_layer_spec(config: TransformerConfig, moe: bool = False, router=None) -> ModuleSpec:  # pragma: no cover
    spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts if moe else None, moe_grouped_gemm=moe and config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm)
    if moe and router is not None:
        spec = with_router(spec, router)
    return spec


def block_spec(config: TransformerConfig, impl: str, vp_stage: int | None, router=None,
               pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """The decoder block for this pipeline stage (and virtual stage): per layer the dense or the
    MoE spec (``config.moe_layer_freq`` as a 0/1 list over all layers), MoE layers with ``router``.
    ``pp_rank``: the stage in a layout other than megatron's global groups (the inference model)."""
    make = te_layer_spec if impl == "transformer_engine" else local_layer_spec
    if impl == "transformer_engine":  # pragma: no cover - needs TE + CUDA
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        final_norm = LocalNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    pattern = config.moe_layer_freq if config.num_moe_experts else [0] * config.num_layers
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    kinds = {kind: make(config, bool(kind), router) for kind in set(pattern[offset:offset + num_layers])}
    return TransformerBlockSubmodules(layer_specs=[kinds[k] for k in pattern[offset:offset + num_layers]],
                                      layer_norm=final_norm)
