"""LayerNorm / RMSNorm for the local (non-TransformerEngine) layer spec.

megatron-core's ``WrappedTorchNorm`` refuses sequence parallelism.  These norms are plain torch
modules whose parameters carry ``sequence_parallel`` so that megatron's
``finalize_model_grads`` sums their gradients over the tensor-parallel group, which is all
sequence parallelism needs from a norm.  The math is :func:`megatron_rl.layout.arch.fp32_norm`.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

from megatron_rl.layout.arch import NORMALIZATIONS, fp32_norm


class _FP32Norm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float, rms: bool):
        super().__init__()
        self.eps = eps
        self.rms = rms
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = (
            None if rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        )
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_norm(x, self.weight, self.bias, self.eps, self.rms)


class LocalNorm:
    """Spec-compatible factory: builds the norm named by ``config.normalization``."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ):
        kind = normalization or config.normalization
        if kind not in NORMALIZATIONS:
            raise ValueError(f"model.normalization={kind!r} is not supported; use one of {', '.join(NORMALIZATIONS)}")
        return _FP32Norm(config, hidden_size, eps, rms=kind == "RMSNorm")
