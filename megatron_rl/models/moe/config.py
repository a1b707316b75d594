"""How model.moe.* maps onto megatron-core's MoE settings, and the router class the layer spec takes."""

from __future__ import annotations

import functools

from megatron_rl.layout.arch import expert_ffn_size, moe_layer_pattern
from megatron_rl.models.moe.router import LossSettings, RLTopKRouter

ROUTER_DTYPES = {"float32": "fp32", "float64": "fp64", "model": None}
# The stats every router accumulates between two calls of moe_metrics: (numerator, denominator)
# pairs, summed over all ranks.


def moe_transformer_kwargs(model_cfg, layout, impl: str) -> dict:
    """``TransformerConfig`` fields of ``model_cfg.moe`` (empty for a dense model).

    megatron's own auxiliary and z-losses stay off: :class:`RLTopKRouter` computes them."""
    moe = model_cfg.moe
    if not moe.num_experts:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=expert_ffn_size(model_cfg),
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=bool(moe.shared_expert_gate and moe.shared_expert_ffn_hidden_size),
        moe_router_score_function=moe.score_function,
        # softmax then top-k, kept as they are == no renormalisation; top-k of the logits then a
        # softmax over them == the chosen experts' softmax scores renormalised to 1.
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.topk_norm,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_router_dtype=ROUTER_DTYPES[moe.router_dtype],
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_token_dispatcher_type=moe.token_dispatcher,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_drop_policy=moe.token_drop_policy,
        moe_layer_freq=moe_layer_pattern(model_cfg),
        moe_grouped_gemm=impl == "transformer_engine",
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )




def router_class(model_cfg):
    """The router for ``MoESubmodules.router``: :class:`RLTopKRouter` with this model's losses."""
    moe = model_cfg.moe
    return functools.partial(RLTopKRouter, losses=LossSettings(moe.load_balancing, moe.aux_loss_coeff,
                                                               moe.z_loss_coeff))
