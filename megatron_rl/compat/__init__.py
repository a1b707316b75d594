"""Workarounds for megatron-core, torch and TransformerEngine, in one place.

Call :func:`enable_compat` once per process before building models.  On a machine without CUDA it
applies the CPU layer (:mod:`megatron_rl.compat.cpu`); patches and workarounds needed everywhere
live in :mod:`megatron_rl.compat.megatron_fixes` and :mod:`megatron_rl.compat.parallel_state`, the
warning filters in :mod:`megatron_rl.compat.warning_filters`.  :mod:`megatron_rl.compat.registry`
lists them all.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _cuda_devices_present() -> bool:
    """Whether this machine has CUDA devices, asked without initialising CUDA.

    ``torch.cuda.is_available()`` initialises the CUDA driver unless
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, and a process that did so cannot fork usable CUDA workers
    (the test forkserver imports this module before forking).  ``torch.cuda.device_count()``
    counts through NVML first and initialises nothing when NVML answers.  The first answer is
    kept: the CPU layer later replaces parts of ``torch.cuda``, never this count."""
    return torch.cuda.device_count() > 0


def cuda_available() -> bool:
    """Whether real CUDA is usable; nothing initialises CUDA before a rank picks its device."""
    return os.environ.get("MEGATRON_RL_FORCE_CPU", "0") in ("", "0") and _cuda_devices_present()


def quiet_known_warnings() -> None:
    """Silence the warnings megatron-core and torch emit here that a user cannot act on
    (:mod:`megatron_rl.compat.warning_filters`); call before importing megatron-core."""
    from megatron_rl.compat.warning_filters import quiet_known_warnings as quiet

    quiet(cpu=not cuda_available())


quiet_optional_dependency_warnings = quiet_known_warnings  # the name benchmarks/ imports


def enable_compat() -> list[str]:
    """Apply every workaround this process needs; safe to call more than once."""
    quiet_known_warnings()
    from megatron_rl.compat.registry import apply_patches

    return apply_patches(cpu=not cuda_available())
