"""The mixture-of-experts terms of the memory planner (:mod:`megatron_rl.planner.memory`).

Per MoE layer the routed experts hold ``E x (3 h I)`` parameters (SwiGLU) split over ``ep x etp``
ranks; everything else -- attention, norms, the router ``E x h``, the shared experts -- is dense
and split over TP as in a dense layer.  So a rank holds its stage's dense parameters / TP plus
its stage's experts / (EP x ETP), and the distributed optimizer shards the experts' state over
the expert data-parallel ranks (``world / (etp x ep x pp)``) instead of DP x CP.

Activations kept for backward, per local token and MoE layer, in 4-byte elements (the dense
MLP's ``4F/tp`` replaced): the router's top-k indices and weights, the permutation's index, the
probabilities by expert and the routing map (``5 k + 1.25 E``); for each of the token's ``k``
routes, its permuted input (``h``, gathered over the expert TP group: ``etp h``), fc1's output,
the activation's output and fc2's input (SwiGLU ``4 I``); the shared experts like a dense MLP of
their size, plus their output and the gate's sigmoid when gated.  ``tests/test_moe.py`` checks
this against ``saved_for_backward`` on EP1, EP2 and TP2 x SP x EP2.  While a layer runs, the
token dispatcher holds the permuted tokens and the all-to-all's receive buffer, ``2 k etp h``
per token (:func:`layer_working_bytes`).

Generation runs on megatron's inference engine (``rollout.engine=megatron``, the only engine with
MoE layers): no weight copy, a paged KV cache of this stage's layers split over TP
(:func:`megatron_rl.planner.memory.engine_kv_cache_bytes`).
"""

from __future__ import annotations

from megatron_rl.layout.arch import expert_ffn_size, moe_layer_pattern


def _ffn_params(h: int, f: int, gated: bool) -> int:
    return h * f * (2 if gated else 1) + f * h


def expert_params_per_layer(cfg) -> int:
    """Routed-expert parameters of one MoE layer."""
    return cfg.moe.num_experts * _ffn_params(cfg.hidden_size, expert_ffn_size(cfg), cfg.activation == "swiglu")


def moe_dense_params_per_layer(cfg, dense_layer_params: int) -> int:
    """Parameters of one MoE layer outside the routed experts: a dense layer's (given) less its
    MLP, plus the router, the shared experts and their gate."""
    h, moe, gated = cfg.hidden_size, cfg.moe, cfg.activation == "swiglu"
    shared = moe.shared_expert_ffn_hidden_size or 0
    return (dense_layer_params - _ffn_params(h, cfg.ffn_hidden_size, gated) + moe.num_experts * h
            + _ffn_params(h, shared, gated) + (h if moe.shared_expert_gate and shared else 0))


def split_params(cfg, dense_layer_params: int) -> tuple[float, float]:
    """``(dense, experts)`` parameters of all layers; ``dense_layer_params`` is one dense layer's."""
    pattern = moe_layer_pattern(cfg)
    moe_layers = sum(pattern)
    dense = (len(pattern) - moe_layers) * dense_layer_params + moe_layers * moe_dense_params_per_layer(
        cfg, dense_layer_params)
    return float(dense), float(moe_layers * expert_params_per_layer(cfg))


def expert_shards(layout) -> int:
    """Ranks one layer's experts are split over: ep x etp (etp defaults to tp)."""
    return getattr(layout, "ep", 1) * (getattr(layout, "etp", None) or layout.tp)


def expert_data_parallel(layout) -> int:
    """Ranks holding the same experts (the distributed optimizer shards their state over them)."""
    world = layout.tp * layout.pp * layout.cp * layout.dp
    return max(1, world // (expert_shards(layout) * layout.pp))


def params_per_gpu(cfg, layout, dense_layer_params: int, embeddings: float) -> float:
    """Parameters on the most loaded pipeline stage: its dense part and ``embeddings`` / TP, its
    experts / (EP x ETP)."""
    dense, experts = split_params(cfg, dense_layer_params)
    return (dense / layout.pp + embeddings) / layout.tp + experts / layout.pp / expert_shards(layout)


def optimizer_params(cfg, layout, p_gpu: float, dense_layer_params: int) -> float:
    """Parameters whose fp32 Adam state this rank keeps: with the distributed optimizer the dense
    ones / (DP x CP) and the experts / expert-DP; all ``p_gpu`` without it."""
    if not layout.distributed_optimizer:
        return p_gpu
    experts = split_params(cfg, dense_layer_params)[1] / layout.pp / expert_shards(layout)
    return (p_gpu - experts) / (layout.dp * layout.cp) + experts / expert_data_parallel(layout)


def activation_elems_per_token_layer(cfg, layout, dense_elems: float) -> float:
    """Average over the layers of elements kept per local token: ``dense_elems`` (a dense layer's,
    as :func:`megatron_rl.planner.memory.activation_elems_per_token_layer` counts it) with the MLP
    term replaced in MoE layers."""
    pattern = moe_layer_pattern(cfg)
    moe_share = sum(pattern) / len(pattern)
    f, tp = cfg.ffn_hidden_size, layout.tp
    sp = tp if layout.sequence_parallel and tp > 1 else 1
    dense_mlp = (4 * f if cfg.activation == "swiglu" else 2 * f) / tp
    moe, h, k = cfg.moe, cfg.hidden_size, cfg.moe.router_topk
    etp = getattr(layout, "etp", None) or tp
    i = expert_ffn_size(cfg)
    gated = cfg.activation == "swiglu"
    # Per route of a token the router sees: the permuted input (gathered over expert TP), fc1's
    # output, the activation's output and fc2's input (SwiGLU: 2I + I + I, split over expert TP,
    # for etp times the tokens).
    routed = k * (etp * h + (4 * i if gated else 2 * i))
    shared = moe.shared_expert_ffn_hidden_size or 0
    shared_mlp = (4 * shared if gated else 2 * shared) / tp
    if shared and moe.shared_expert_gate:
        shared_mlp += h / tp + 1  # the shared output kept for the gate's product, the gate's sigmoid
    # The router's top-k indices (int64) and weights, the permutation's token index (int64), the
    # probabilities by expert and the routing map (bool), in 4-byte units.
    router = 5 * k + 1.25 * moe.num_experts
    combine = h + 2  # what the weighted sum of the routes keeps (measured, tests/test_moe.py)
    # The router and the experts see this TP rank's sequence-parallel slice of the tokens.
    moe_layer = dense_elems - dense_mlp + (router + routed + combine) / sp + shared_mlp
    return (1 - moe_share) * dense_elems + moe_share * moe_layer


def layer_working_bytes(cfg, layout, tokens_local: int, bytes_per: int, training: bool, dense: float) -> float:
    """The largest MLP working set of one layer beyond what is kept: ``dense`` (a dense layer's,
    counted by :func:`megatron_rl.planner.memory.layer_working_bytes`) when the model has dense
    layers, and an MoE layer's: the dispatcher's permuted tokens and all-to-all receive buffer
    (``2 k etp h``, gathered over expert TP) with, forward only, the experts' intermediates
    (SwiGLU ``5 I`` per route) or, with backward, their gradients (``4 I`` per route)."""
    k, h, i = cfg.moe.router_topk, cfg.hidden_size, expert_ffn_size(cfg)
    etp = getattr(layout, "etp", None) or layout.tp
    ffn = (4 if training else 5 if cfg.activation == "swiglu" else 2) * i
    sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1  # the router's share of the tokens
    routed = k * (2 * etp * h + ffn) * tokens_local / sp * bytes_per
    return max(routed, dense) if 0 in moe_layer_pattern(cfg) else routed


def layout_options(cfg, gpus: int, tp: int, pp: int) -> list[tuple[int, int]]:
    """``(ep, etp)`` pairs worth planning for an MoE model on this dense layout: EP dividing the
    experts with etp*ep*pp dividing the world, and ETP 1 or TP (etp = tp is megatron's default)."""
    out = []
    for etp in sorted({1, tp}):
        if expert_ffn_size(cfg) % etp:
            continue
        for ep in (1, 2, 4, 8, 16, 32, 64):
            if cfg.moe.num_experts % ep == 0 and gpus % (etp * ep * pp) == 0:
                out.append((ep, etp))
    return out


# The config keys of expert parallelism a plan decides.
SETTINGS_KEYS = ("parallel.ep", "parallel.etp")


def settings(layout) -> dict:
    """``layout``'s expert parallelism as config values: EP, and ETP (null = TP)."""
    etp = getattr(layout, "etp", None)
    return {"parallel.ep": getattr(layout, "ep", 1), "parallel.etp": None if etp in (None, layout.tp) else etp}
