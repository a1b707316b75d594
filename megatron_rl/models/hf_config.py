"""Hugging Face ``config.json`` -> our :class:`ModelConfig` (Llama 2/3, Qwen2/2.5, Qwen3, Mistral,
and the mixtures of experts Qwen3-MoE and Qwen2-MoE).

Anything the Megatron model cannot reproduce exactly (a RoPE scaling other than YaRN or Llama-3's
with megatron-core's fixed factors, biases megatron has no slot for, sliding-window attention) is
a clear config error, never a silent approximation.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

from megatron_rl.config.schema import ModelConfig, MoEConfig, RopeScalingConfig
from megatron_rl.errors import ConfigError
from megatron_rl.layout.arch import LLAMA3_ROPE_FIXED, yarn_attention_factor, yarn_original_positions

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


# HF yarn keys -> ours (same meaning); HF's attention_factor is checked against the one they imply.
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")


def rope_scaling_from_hf(scaling: dict | None, base: RopeScalingConfig, max_positions: int) -> RopeScalingConfig:
    """HF ``rope_scaling`` -> ours.  Without one in config.json the YAML's ``model.rope_scaling``
    stands (how Qwen enables YaRN on a checkpoint that ships without it); with both, they must agree."""
    if not scaling:
        return base
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return base
    if kind == "llama3":
        fixed = LLAMA3_ROPE_FIXED
        if any(float(scaling.get(k, v)) != v for k, v in fixed.items()):
            raise ConfigError("model.hf_path", f"rope_scaling={scaling}",
                              f"only Llama-3 RoPE scaling with low/high frequency factors "
                              f"{fixed['low_freq_factor']:g}/{fixed['high_freq_factor']:g} and original length "
                              f"{fixed['original_max_position_embeddings']} is supported "
                              "(megatron-core's fixed values)",
                              "use a model with default or Llama-3.1 style RoPE")
        ours = RopeScalingConfig(type="llama3", factor=float(scaling["factor"]))
    elif kind == "yarn":
        ours = RopeScalingConfig(type="yarn", **{k: scaling[k] for k in _YARN_KEYS if scaling.get(k) is not None})
        if ours.factor is None:  # DeepSeek-V3 style: HF takes the ratio of the two windows
            original = ours.original_max_position_embeddings or max_positions
            ours = dataclasses.replace(ours, factor=max_positions / original)
        _check_attention_factor(scaling, ours)
    else:
        raise ConfigError("model.hf_path", f"rope_scaling={scaling}",
                          f"RoPE scaling type {kind!r} is not supported (llama3 and yarn are)",
                          "use a model with default, llama3 or yarn RoPE scaling; to run past the native window "
                          "replace it by yarn in config.json")
    if base.type != "none" and base != ours:
        raise ConfigError("model.rope_scaling", base.type, f"differs from config.json's rope_scaling={scaling}",
                          "drop model.rope_scaling from the YAML (config.json's is used) or edit config.json")
    return ours


def _check_attention_factor(scaling: dict, ours: RopeScalingConfig) -> None:
    given = scaling.get("attention_factor")
    implied = yarn_attention_factor(ours)
    if given is not None and abs(float(given) - implied) > 1e-9 * implied:
        raise ConfigError("model.hf_path", f"rope_scaling.attention_factor={given}",
                          f"megatron-core's YaRN derives the attention factor from factor/mscale ({implied:.6g})",
                          "drop attention_factor from config.json's rope_scaling (or set it to that value)")


def hf_rope_scaling(model_cfg: ModelConfig) -> dict | None:
    """Our ``model.rope_scaling`` as HF writes it in config.json (None: plain RoPE)."""
    rs = model_cfg.rope_scaling
    if rs.type == "llama3":
        return {"rope_type": "llama3", "factor": rs.factor, **LLAMA3_ROPE_FIXED}
    if rs.type == "yarn":
        out = {"rope_type": "yarn", "factor": rs.factor,
               "original_max_position_embeddings": yarn_original_positions(model_cfg),
               "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "truncate": rs.truncate}
        out.update({k: getattr(rs, k) for k in ("mscale", "mscale_all_dim") if getattr(rs, k) is not None})
        return out
    return None


def hf_config_with_rope_scaling(hf: dict, model_cfg: ModelConfig) -> dict:
    """``hf`` (a config.json) carrying ``model_cfg.rope_scaling``: unchanged when it already
    describes it, else with its rope_scaling (or transformers 5's rope_parameters) replaced, so an
    exported model runs in HF as it was trained (YaRN enabled from the YAML included)."""
    theta, scaling = _rope(hf)
    try:
        current = rope_scaling_from_hf(scaling, RopeScalingConfig(), hf.get("max_position_embeddings", 0))
    except ConfigError:
        current = None
    if current == model_cfg.rope_scaling:
        return hf
    out = copy.deepcopy(hf)
    new = hf_rope_scaling(model_cfg)
    if out.get("rope_parameters"):
        out["rope_parameters"] = {"rope_theta": theta, "rope_type": "default", **(new or {})}
    else:
        out["rope_scaling"] = new
    return out


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
        rope_scaling=rope_scaling_from_hf(
            scaling, base.rope_scaling, hf.get("max_position_embeddings", base.max_position_embeddings)),
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
