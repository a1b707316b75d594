"""LoRA's arithmetic: which projections a ``target_modules`` list names, their shapes, and how each
adapter splits over tensor parallelism.

Users name projections as Hugging Face and peft do (``q_proj`` ... ``down_proj``).  megatron fuses
some of them -- ``linear_qkv`` holds q, k and v, ``linear_fc1`` holds ``[gate; up]`` -- so each named
projection gets an adapter of its own on the fused layer, exactly the adapters peft puts on the
separate HF layers (a fused adapter with one A for q, k and v would be a different model, and
peft could not load it).

An adapter is ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]`` (peft's names and shapes),
its output scaled by ``alpha / rank``.  On megatron's column-parallel layers (q, k, v, gate, up)
``lora_B`` is split on its rows over TP, ``lora_A`` replicated; on row-parallel layers (o, down)
``lora_A`` is split on its columns, ``lora_B`` replicated.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.layout.arch import ACTIVATIONS, attention_dims, is_moe

ALL_LINEAR = "all-linear"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION + MLP
# The megatron layer (within a transformer layer) that holds each projection.
LAYER_OF = {
    "q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2",
}
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Projection:
    """One adapted projection: canonical (TP=1) ``in_features`` / ``out_features``; ``row_parallel``
    says which adapter matrix TP splits (A's columns if so, else B's rows)."""

    name: str
    in_features: int
    out_features: int

    @property
    def row_parallel(self) -> bool:
        return self.name in ROW_PARALLEL

    @property
    def layer(self) -> str:
        return LAYER_OF[self.name]


ADAPTER_MARK = ".lora."


def is_adapter_param(name: str) -> bool:
    """A LoRA adapter tensor (``decoder.layers.i.lora.<proj>.lora_A/B.weight``), not a base weight."""
    return ADAPTER_MARK in name


def hf_module(projection: str) -> str:
    """The HF module of ``projection`` inside ``model.layers.i``."""
    return f"self_attn.{projection}" if projection in ATTENTION else f"mlp.{projection}"


def lora_on(lora) -> bool:
    return bool(lora is not None and lora.rank > 0)


def unknown_targets(targets) -> list[str]:
    return [t for t in targets if t != ALL_LINEAR and t not in PROJECTIONS]


def target_names(model_cfg, targets) -> tuple[str, ...]:
    """The projections ``targets`` names on ``model_cfg``, in a fixed order (``all-linear``: every
    projection the model has; a non-gated MLP has no ``gate_proj``)."""
    wanted = set(PROJECTIONS if ALL_LINEAR in targets else targets)
    gated = ACTIVATIONS[model_cfg.activation][0]
    return tuple(p for p in PROJECTIONS if p in wanted and (gated or p != "gate_proj"))


def projections(model_cfg, targets) -> tuple[Projection, ...]:
    heads, kv_heads, head_dim = attention_dims(model_cfg)
    hidden, ffn = model_cfg.hidden_size, model_cfg.ffn_hidden_size
    shapes = {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden),
    }
    return tuple(Projection(n, *shapes[n]) for n in target_names(model_cfg, targets))


def adapter_params(model_cfg, lora, tp: int = 1) -> int:
    """Adapter parameters one TP rank holds (every layer; PP splits the layers), 0 without LoRA."""
    if not lora_on(lora):
        return 0
    per_layer = 0
    for p in projections(model_cfg, lora.target_modules):
        if p.row_parallel:
            per_layer += lora.rank * (p.in_features // tp) + p.out_features * lora.rank
        else:
            per_layer += lora.rank * p.in_features + (p.out_features // tp) * lora.rank
    return per_layer * model_cfg.num_layers


def moe_mlp_targets(model_cfg, targets) -> list[str]:
    """MLP projections named on a mixture-of-experts model (per-expert adapters are not built)."""
    if not is_moe(model_cfg):
        return []
    return [p for p in target_names(model_cfg, targets) if p in MLP]


# The layers an int8 base (``lora.quantize_base``) holds in 8 bits, within each transformer layer;
# the embedding, output layer, norms and biases keep the model's dtype.
QUANTIZED_LAYERS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
INT8_SCALE_BYTES = 4  # one fp32 scale per output row


def int8_base(lora) -> bool:
    """A LoRA model whose frozen base is held in int8."""
    return lora_on(lora) and lora.quantize_base == "int8"


def int8_base_saving(model_cfg, lora, tp: int = 1, param_bytes: int = 2) -> float:
    """Bytes one TP rank saves (every layer; PP splits the layers) by holding the base's projections
    in int8: a byte per weight instead of ``param_bytes``, less one scale per row the rank holds (a
    column-parallel layer's share of rows; a row-parallel layer's every row).  0 without it; on a
    mixture-of-experts model the attention projections only (the experts keep the model's dtype)."""
    if not int8_base(lora):
        return 0.0
    per_layer = 0.0
    for p in projections(model_cfg, ATTENTION if is_moe(model_cfg) else [ALL_LINEAR]):
        rows = p.out_features if p.row_parallel else p.out_features / tp
        per_layer += p.in_features * p.out_features / tp * (param_bytes - 1) - rows * INT8_SCALE_BYTES
    return per_layer * model_cfg.num_layers
