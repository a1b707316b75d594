"""What this machine can do: CUDA present, TransformerEngine importable, flash-attn's paged
kernels importable, the layer implementation ``auto`` resolves to.

It sits below both ``config/`` (validation checks resolved values, not ``auto``) and ``models/``
(the builder picks the spec), and imports neither megatron-core nor the model code.
"""

from __future__ import annotations

import functools
import importlib.util

from megatron_rl.compat import cuda_available
from megatron_rl.compat.paged_attention import paged_flash_attention_installed
from megatron_rl.config.choices import BACKENDS, DEVICES, TRANSFORMER_IMPLS  # noqa: F401 - read here by users
from megatron_rl.errors import ConfigError


@functools.lru_cache(maxsize=1)
def te_version() -> str | None:
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        from transformer_engine import __version__ as version  # type: ignore

        return str(version)
    except Exception:  # noqa: BLE001 - an installed but broken TE (no CUDA libraries) raises anything
        return None


def paged_kernels_installed() -> bool:
    """Whether megatron's dynamic engine has paged attention kernels for CUDA: flash-attn's, or the
    Triton kernel (:mod:`megatron_rl.ops.paged_attention`; Triton ships with torch's CUDA wheels)."""
    return paged_flash_attention_installed() or importlib.util.find_spec("triton") is not None


def te_usable() -> bool:
    return cuda_available() and te_version() is not None


def resolve_transformer_impl(requested: str) -> str:
    """``auto`` -> TransformerEngine when it imports and CUDA is present, else ``local``."""
    if requested == "auto":
        return "transformer_engine" if te_usable() else "local"
    if requested not in TRANSFORMER_IMPLS:
        raise ConfigError("model.transformer_impl", requested, "unknown implementation",
                          "use auto, " + " or ".join(TRANSFORMER_IMPLS))
    if requested == "transformer_engine" and not te_usable():
        why = "TransformerEngine is not installed" if te_version() is None else "CUDA is not available"
        raise ConfigError(
            "model.transformer_impl", requested, why,
            "pip install -e .[gpu] on a CUDA machine, or use model.transformer_impl=local",
            row="TransformerEngine layer spec",
        )
    return requested
