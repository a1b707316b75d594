"""Seeded random weights for a dense model, by canonical name, for tests and benchmarks.

The names and shapes are those of :mod:`megatron_rl.models.canonical` at TP=1 / PP=1 with the
local layer spec's norm names and the true vocabulary, read from the config alone, so a state dict
exists before any process group or model is built (``load_canonical`` puts it on any layout).
"""

from __future__ import annotations

import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.layout.arch import ACTIVATIONS, attention_dims


def canonical_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{canonical name: shape}`` of a dense GPT with ``model_cfg``'s sizes."""
    cfg = model_cfg
    heads, groups, head_dim = attention_dims(cfg)
    hidden, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    gated = ACTIVATIONS[cfg.activation][0]
    layer_norm = cfg.normalization == "LayerNorm"

    def norm(prefix: str, size: int) -> dict:
        return {f"{prefix}.weight": (size,), **({f"{prefix}.bias": (size,)} if layer_norm else {})}

    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_layers):
        layer = f"decoder.layers.{i}"
        attn = f"{layer}.self_attention"
        shapes.update(norm(f"{layer}.input_layernorm", hidden))
        qkv = (heads + 2 * groups) * head_dim
        shapes[f"{attn}.linear_qkv.weight"] = (qkv, hidden)
        if cfg.add_bias_linear or cfg.add_qkv_bias:
            shapes[f"{attn}.linear_qkv.bias"] = (qkv,)
        if cfg.qk_layernorm:
            shapes.update(norm(f"{attn}.q_layernorm", head_dim))
            shapes.update(norm(f"{attn}.k_layernorm", head_dim))
        shapes[f"{attn}.linear_proj.weight"] = (hidden, heads * head_dim)
        if cfg.add_bias_linear:
            shapes[f"{attn}.linear_proj.bias"] = (hidden,)
        shapes.update(norm(f"{layer}.pre_mlp_layernorm", hidden))
        shapes[f"{layer}.mlp.linear_fc1.weight"] = ((2 if gated else 1) * ffn, hidden)
        if cfg.add_bias_linear:
            shapes[f"{layer}.mlp.linear_fc1.bias"] = ((2 if gated else 1) * ffn,)
        shapes[f"{layer}.mlp.linear_fc2.weight"] = (hidden, ffn)
        if cfg.add_bias_linear:
            shapes[f"{layer}.mlp.linear_fc2.bias"] = (hidden,)
    shapes.update(norm("decoder.final_layernorm", hidden))
    if not cfg.tie_word_embeddings:
        shapes["output_layer.weight"] = (cfg.vocab_size, hidden)
    return shapes


def random_canonical(model_cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A seeded random canonical state dict (fp32, CPU): norm weights near 1, biases and the rest
    scaled noise."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in canonical_shapes(model_cfg).items():
        noise = torch.randn(shape, generator=gen)
        if "layernorm" in name and name.endswith(".weight"):
            state[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            state[name] = 0.1 * noise
        else:
            state[name] = std * noise
    return state


def random_adapters(model_cfg: ModelConfig, lora, seed: int = 0, std: float = 0.1) -> dict[str, torch.Tensor]:
    """Canonical LoRA adapters (A and B both non-zero) for every layer and targeted projection."""
    from megatron_rl.layout.lora import projections

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(model_cfg.num_layers):
        for proj in projections(model_cfg, lora.target_modules):
            prefix = f"decoder.layers.{layer}.lora.{proj.name}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(lora.rank, proj.in_features, generator=g) * std
            out[f"{prefix}.lora_B.weight"] = torch.randn(proj.out_features, lora.rank, generator=g) * std
    return out


def load_random_adapters(chunks, model_cfg: ModelConfig, lora, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`random_adapters` loaded into ``chunks`` (any layout); returns them."""
    from megatron_rl.models.canonical import load_canonical

    adapters = random_adapters(model_cfg, lora, seed)
    load_canonical(chunks, adapters, strict=False)
    return adapters
