"""The precision the ops compute in, whatever the model's dtype."""

from __future__ import annotations

import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs, so softmax statistics never round in half precision;
    float64 stays float64 (what the exactness tests feed in)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32
