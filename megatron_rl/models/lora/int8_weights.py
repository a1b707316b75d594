"""What an int8 base weight is (:mod:`megatron_rl.models.lora.quantized_base` makes them): an int8
parameter carrying ``quant_scale`` (one fp32 scale per row) and ``dequant_dtype``, read as
``q * scale`` in that dtype.  Apart from the quantizing layer so that what reads weights
(:mod:`megatron_rl.models.canonical`) depends on the format only.
"""

from __future__ import annotations

import torch


def is_quantized(param: torch.Tensor) -> bool:
    """A base weight held as int8 with its row scales."""
    return param.dtype == torch.int8 and hasattr(param, "quant_scale")


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an int8 base computes with: ``q * scale`` per row, in fp32, then ``dtype``."""
    return (q.to(torch.float32) * scale.to(q.device)[:, None]).to(dtype)


def dequantized(param: torch.Tensor) -> torch.Tensor:
    """``param`` as the model computes with it: dequantized if it is an int8 base weight."""
    return dequantize(param, param.quant_scale, param.dequant_dtype) if is_quantized(param) else param
