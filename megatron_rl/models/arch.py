"""Architecture facts shared by the builder, the HF bridge, the rollout decoder and the planner.

Pure Python and torch (no megatron-core), so config validation can import the choice lists and the
second implementation of the model's math (``rollout/decoder.py``) reads the same facts the
megatron model is built from.
"""

from __future__ import annotations

import torch

# model.activation -> (megatron gated_linear_unit, activation function)
ACTIVATIONS = {
    "swiglu": (True, torch.nn.functional.silu),
    "gelu": (False, torch.nn.functional.gelu),
}
ACTIVATION_NAMES = tuple(ACTIVATIONS)

NORMALIZATIONS = ("RMSNorm", "LayerNorm")

# model.params_dtype -> torch dtype; "auto" resolves by device (see resolve_dtype).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PARAMS_DTYPES = ("auto",) + tuple(DTYPES)

# megatron-core's activation-recompute settings (TransformerConfig).
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe_act")


def resolve_dtype(name: str, device) -> torch.dtype:
    """``model.params_dtype`` -> torch dtype: ``auto`` is bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[name]
