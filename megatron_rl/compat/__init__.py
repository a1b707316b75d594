"""Workarounds for megatron-core, torch and TransformerEngine, in one place.

Call :func:`enable_compat` once per process before building models.  On a machine without CUDA it
applies the CPU layer (:mod:`megatron_rl.compat.cpu`); patches that apply everywhere live in
:mod:`megatron_rl.compat.megatron_fixes`.  :func:`megatron_rl.compat.registry.all_patches` lists them.
"""

from __future__ import annotations

import os
import warnings

import torch

_CUDA_AT_IMPORT = torch.cuda.is_available()


def cuda_available() -> bool:
    """Whether real CUDA is usable (answered before any CPU patch touched ``torch.cuda``)."""
    return _CUDA_AT_IMPORT and os.environ.get("MEGATRON_RL_FORCE_CPU", "0") in ("", "0")


def quiet_optional_dependency_warnings() -> None:
    """megatron-core warns at import time about missing Apex/TE; we report that in `features`."""
    for pattern in (
        ".*Transformer Engine and Apex are not installed.*",
        ".*Apex is not installed.*",
        ".*Transformer Engine is not installed.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)
    # torch 2.13 deprecates all_gather_into_tensor, which megatron-core 0.16 (and torch 2.11 on
    # GPU machines) still use; the warning is not actionable for users.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*is deprecated.*")
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*is deprecated.*")


def enable_compat() -> list[str]:
    """Apply every workaround this process needs; safe to call more than once."""
    quiet_optional_dependency_warnings()
    from megatron_rl.compat import cpu as _cpu  # noqa: F401  (registers patches)
    from megatron_rl.compat import megatron_fixes as _fixes  # noqa: F401
    from megatron_rl.compat.registry import apply_patches

    return apply_patches(cpu=not cuda_available())
