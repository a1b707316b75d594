"""Architecture facts shared by the builder, the HF bridge and the planner.

Pure Python and torch (no megatron-core), so validation and the planner read it, and the test
oracle decoder (``tests/support/decoder.py``) reads the same facts the megatron model is built
from.  It sits in ``layout/`` (not ``models/``) so the layout rules read it without importing the
model package, which imports ``distributed/``.  The choice lists live in ``config/choices.py``.
"""

from __future__ import annotations

import math
import re

import torch

from megatron_rl.config.choices import (  # noqa: F401 - the choice sets, read here by their users
    ACTIVATION_NAMES,
    DTYPE_NAMES,
    MOE_DISPATCHERS,
    MOE_DROP_POLICIES,
    MOE_LOAD_BALANCING,
    MOE_ROUTER_DTYPES,
    MOE_SCORE_FUNCTIONS,
    NORMALIZATIONS,
    PARAMS_DTYPES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODULES,
    require_same,
)

# model.activation -> (megatron gated_linear_unit, activation function)
ACTIVATIONS = {
    "swiglu": (True, torch.nn.functional.silu),
    "gelu": (False, torch.nn.functional.gelu),
}
require_same(ACTIVATIONS, ACTIVATION_NAMES, "model.activation")

# model.params_dtype -> torch dtype; "auto" resolves by device (see resolve_dtype).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
require_same(DTYPES, DTYPE_NAMES, "model.params_dtype")


def resolve_dtype(name: str, device) -> torch.dtype:
    """``model.params_dtype`` -> torch dtype: ``auto`` is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[name]


def attention_dims(model_cfg) -> tuple[int, int, int]:
    """``(heads, kv_heads, head_dim)`` with megatron's defaults: no ``num_query_groups`` means
    one KV head per head, no ``kv_channels`` means ``hidden_size / heads``.

    Takes our ``ModelConfig`` or megatron's ``TransformerConfig`` (same field names)."""
    heads = model_cfg.num_attention_heads
    return heads, model_cfg.num_query_groups or heads, model_cfg.kv_channels or model_cfg.hidden_size // heads


# Llama-3 RoPE scaling as megatron-core applies it: GPTModel(rope_scaling=True) calls
# RotaryEmbedding._apply_scaling with only the factor configurable; the low/high frequency factors
# and the original context length keep its defaults (1, 4, 8192).  HF's names for them:
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# GPTModel's own rope_scaling_factor default; passed when model.rope_scaling.type is not llama3
# (megatron ignores it then, as rope_scaling is off).
MEGATRON_ROPE_SCALING_FACTOR = 8.0


def yarn_original_positions(model_cfg) -> int:
    """The window a YaRN model was pretrained on (HF's default: ``max_position_embeddings``)."""
    return model_cfg.rope_scaling.original_max_position_embeddings or model_cfg.max_position_embeddings


def max_positions(model_cfg) -> int:
    """Longest sequence (prompt + response) the model's RoPE is meant for: the native
    ``max_position_embeddings``, or with YaRN ``factor x original_max_position_embeddings`` when
    that is longer (Qwen's configs keep the native 32768 next to a YaRN factor of 4)."""
    rs = model_cfg.rope_scaling
    if rs.type == "yarn" and rs.factor:
        return max(model_cfg.max_position_embeddings, int(rs.factor * yarn_original_positions(model_cfg)))
    return model_cfg.max_position_embeddings


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(rope_scaling) -> float:
    """YaRN's attention factor ("mscale"), which multiplies RoPE's cos and sin (so q.k by its
    square), by HF's rule: the mscale / mscale_all_dim ratio when both are set (non-zero), else
    ``0.1 ln(factor) + 1``."""
    factor = rope_scaling.factor
    if rope_scaling.mscale and rope_scaling.mscale_all_dim:
        return _yarn_mscale(factor, rope_scaling.mscale) / _yarn_mscale(factor, rope_scaling.mscale_all_dim)
    return _yarn_mscale(factor)


def rope_mscale(model_cfg) -> float:
    """The factor RoPE's cos and sin carry: YaRN's attention factor, else 1."""
    rs = model_cfg.rope_scaling
    return yarn_attention_factor(rs) if rs.type == "yarn" else 1.0


def yarn_megatron_mscales(rope_scaling) -> tuple:
    """``(yarn_mscale, yarn_mscale_all_dim)`` for megatron-core that give HF's attention factor:
    megatron takes the ratio whenever both are not None, HF only when both are non-zero."""
    if rope_scaling.mscale and rope_scaling.mscale_all_dim:
        return float(rope_scaling.mscale), float(rope_scaling.mscale_all_dim)
    return None, None


def rope_inv_freq(head_dim: int, base: float, model_cfg) -> tuple[torch.Tensor, float]:
    """``(fp32 inverse frequencies, cos/sin multiplier)`` of ``model_cfg.rope_scaling``, computed
    on the CPU the way megatron-core's ``RotaryEmbedding`` / ``YarnRotaryEmbedding`` (and HF) do."""
    rs = model_cfg.rope_scaling
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rs.type == "llama3":
        return _llama3_inv_freq(inv_freq, rs.factor), 1.0
    if rs.type == "yarn":
        original = yarn_original_positions(model_cfg)
        low, high = _yarn_correction_range(rs.beta_fast, rs.beta_slow, head_dim, base, original, rs.truncate)
        if low == high:
            high += 0.001  # as both implementations do
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1.0 - ramp  # 1: high frequency, kept; 0: low frequency, divided by the factor
        inter = 1.0 / (rs.factor * base ** exponents)
        return inter * (1 - keep) + inv_freq * keep, rope_mscale(model_cfg)
    return inv_freq, 1.0


def _yarn_correction_range(beta_fast, beta_slow, dim, base, original, truncate) -> tuple:
    def dim_of(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama-3: keep high frequencies, divide low ones by the factor, blend in between."""
    low_freq_factor = LLAMA3_ROPE_FIXED["low_freq_factor"]
    high_freq_factor = LLAMA3_ROPE_FIXED["high_freq_factor"]
    original = LLAMA3_ROPE_FIXED["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high_freq_factor) & (wavelen <= original / low_freq_factor)
    return torch.where(medium, blended, scaled)


def fp32_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
              rms: bool) -> torch.Tensor:
    """RMSNorm (``bias`` unused) or LayerNorm computed in fp32 and cast back to ``x.dtype``, as HF
    computes it; the trainer's norms call this (and the test oracle decoder), so they agree."""
    dtype = x.dtype
    x = x.float()
    if rms:
        y = weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    else:
        y = torch.nn.functional.layer_norm(x, (x.size(-1),), weight.float(), bias.float(), eps)
    return y.to(dtype)


# TransformerEngine fuses the pre-attention / pre-MLP norms into the next linear layer, so a TE
# model names the same tensors differently.  TE name -> local-spec (canonical) name, per layer.
TE_FUSED_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def local_norm_name(name: str) -> str:
    """The local-spec name of a parameter named the TE way (a layer-relative or full name);
    other names are returned unchanged."""
    for te, local in TE_FUSED_NORM_NAMES.items():
        if name == te or name.endswith("." + te):
            return name[: len(name) - len(te)] + local
    return name


# Mixture of experts (model.moe.*): which layers hold experts.  Pure Python, so validation and
# the planner read the same facts.


def moe_layer_pattern(model_cfg) -> list[int]:
    """1 for each layer with experts, 0 for a dense MLP: every ``moe.layer_freq``-th layer counting
    from layer 0 (megatron-core's rule), less the layers in ``moe.dense_layers`` (HF
    ``mlp_only_layers``); all 0 for a dense model."""
    moe = getattr(model_cfg, "moe", None)
    if moe is None or not moe.num_experts:
        return [0] * model_cfg.num_layers
    dense = {int(i) for i in moe.dense_layers}
    return [int(i % moe.layer_freq == 0 and i not in dense) for i in range(model_cfg.num_layers)]


def is_moe(model_cfg) -> bool:
    return any(moe_layer_pattern(model_cfg))


def expert_ffn_size(model_cfg) -> int:
    """Hidden units of one routed expert (``moe.ffn_hidden_size``, default ``ffn_hidden_size``)."""
    return model_cfg.moe.ffn_hidden_size or model_cfg.ffn_hidden_size


# Routed experts in canonical form are named as an EP=1 local-spec model names them:
# ``mlp.experts.local_experts.{global expert}.linear_fc{1,2}.weight``.  TransformerEngine's grouped
# GEMM holds them as ``mlp.experts.linear_fc{1,2}.weight{local expert}``.
_LOCAL_EXPERT = re.compile(r"^(.*\bmlp\.experts\.)local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT = re.compile(r"^(.*\bmlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")


def is_expert_param(name: str) -> bool:
    """A routed expert's parameter (sharded over EP and expert TP), by its name."""
    return ".mlp.experts." in name or name.startswith("mlp.experts.")


def global_expert_name(name: str, local_expert_indices) -> str:
    """``name`` with a local expert number replaced by the global one (``local_expert_indices[j]``
    for local expert ``j``), in the local-spec form; other names unchanged."""
    m = _LOCAL_EXPERT.match(name)
    if m:
        return f"{m.group(1)}local_experts.{local_expert_indices[int(m.group(2))]}.{m.group(3)}"
    m = _GROUPED_EXPERT.match(name)
    if m:
        return f"{m.group(1)}local_experts.{local_expert_indices[int(m.group(4))]}.{m.group(2)}.{m.group(3)}"
    return name


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Rows megatron gives the vocabulary: a multiple of ``divisible_by * tp``, so every TP rank
    holds the same number."""
    multiple = max(1, divisible_by) * tp
    return -(-vocab_size // multiple) * multiple
