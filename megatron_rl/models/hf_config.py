"""Hugging Face ``config.json`` -> our :class:`ModelConfig` (Llama 2/3, Qwen2/2.5, Qwen3, Mistral,
and the mixtures of experts Qwen3-MoE and Qwen2-MoE).

Anything the Megatron model cannot reproduce exactly (a RoPE scaling other than Llama-3's with
megatron-core's fixed factors, biases megatron has no slot for, sliding-window attention) is a
clear config error, never a silent approximation.
"""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_rl.config.schema import ModelConfig, MoEConfig
from megatron_rl.errors import ConfigError
from megatron_rl.models.arch import LLAMA3_ROPE_FIXED

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe")
MOE_KINDS = ("qwen3_moe", "qwen2_moe")


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError("model.hf_path", hf_dir, "no config.json in this directory",
                          "point model.hf_path (or --hf-model) at a local Hugging Face model directory")
    with open(path) as fh:
        return json.load(fh)


def _rope(hf: dict) -> tuple[float, dict | None]:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or None
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if params and params.get("rope_type", "default") != "default":
        scaling = params
    return float(theta), scaling


def model_config_from_hf(hf: dict, base: ModelConfig | None = None) -> ModelConfig:
    """Architecture fields from ``hf``; everything else (impl, recompute, dtype...) from ``base``."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise ConfigError("model.hf_path", kind, "unsupported architecture",
                          f"use one of {', '.join(SUPPORTED)} (see docs/feature_matrix.md)")
    if hf.get("mlp_bias"):
        raise ConfigError("model.hf_path", kind, "MLP biases are not supported", "use a model without mlp_bias")
    qkv_bias = kind == "qwen2" or bool(hf.get("attention_bias")) or (kind == "qwen2_moe" and hf.get("qkv_bias", True))
    if kind in ("llama", "mistral") and hf.get("attention_bias"):
        raise ConfigError("model.hf_path", kind, "attention_bias adds an o_proj bias megatron cannot hold",
                          "use a checkpoint without attention_bias")
    if hf.get("use_sliding_window") or (kind == "mistral" and hf.get("sliding_window")):
        window = hf.get("sliding_window")
        if window is not None and window < hf.get("max_position_embeddings", 0):
            raise ConfigError("model.hf_path", f"sliding_window={window}",
                              "sliding-window attention is not implemented",
                              "use a checkpoint without a sliding window (e.g. Mistral v0.2+), "
                              "or set sliding_window >= max_position_embeddings in its config.json")
    theta, scaling = _rope(hf)
    factor = None
    if scaling:
        kind_s = scaling.get("rope_type", scaling.get("type"))
        if kind_s != "llama3" or any(float(scaling.get(k, v)) != v for k, v in LLAMA3_ROPE_FIXED.items()):
            fixed = LLAMA3_ROPE_FIXED
            raise ConfigError("model.hf_path", f"rope_scaling={scaling}",
                              f"only Llama-3 RoPE scaling with low/high frequency factors "
                              f"{fixed['low_freq_factor']:g}/{fixed['high_freq_factor']:g} and original length "
                              f"{fixed['original_max_position_embeddings']} is supported "
                              "(megatron-core's fixed values)",
                              "use a model with default or Llama-3.1 style RoPE")
        factor = float(scaling["factor"])
    heads = hf["num_attention_heads"]
    base = base or ModelConfig()
    return dataclasses.replace(
        base,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", base.max_position_embeddings),
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu" if hf.get("hidden_act", "silu") == "silu" else _bad_act(hf),
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        qk_layernorm=kind in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rotary_base=theta,
        rope_scaling_factor=factor,
        moe=_moe(hf, kind, base.moe),
    )


def _moe(hf: dict, kind: str, base: MoEConfig) -> MoEConfig:
    """The experts of a Qwen3-MoE / Qwen2-MoE config (none for the other families).  Training
    settings (loss coefficients, dispatcher, capacity) stay ``base``'s."""
    experts = hf.get("num_experts", hf.get("num_local_experts")) if kind in MOE_KINDS else None
    if not experts:
        return dataclasses.replace(base, num_experts=None)
    layers, step = hf["num_hidden_layers"], int(hf.get("decoder_sparse_step", 1) or 1)
    dense_only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    dense = [i for i in range(layers) if i in dense_only or (i + 1) % step]
    shared = hf.get("shared_expert_intermediate_size") if kind == "qwen2_moe" else None
    return dataclasses.replace(
        base, num_experts=int(experts), router_topk=int(hf["num_experts_per_tok"]),
        ffn_hidden_size=int(hf["moe_intermediate_size"]), shared_expert_ffn_hidden_size=shared or None,
        shared_expert_gate=bool(shared), score_function="softmax", topk_norm=bool(hf.get("norm_topk_prob", False)),
        topk_scaling_factor=None, layer_freq=1, dense_layers=dense,
    )


def _bad_act(hf: dict):
    raise ConfigError("model.hf_path", f"hidden_act={hf.get('hidden_act')}", "unsupported activation",
                      "use a SwiGLU (silu) model")
