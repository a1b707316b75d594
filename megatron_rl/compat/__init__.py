"""Workarounds for megatron-core, torch and TransformerEngine, in one place.

Call :func:`enable_compat` once per process before building models.  On a machine without CUDA it
applies the CPU layer (:mod:`megatron_rl.compat.cpu`); patches and workarounds needed everywhere
live in :mod:`megatron_rl.compat.megatron_fixes` and :mod:`megatron_rl.compat.parallel_state`, the
warning filters in :mod:`megatron_rl.compat.warning_filters`.  :mod:`megatron_rl.compat.registry`
lists them all.
"""

from __future__ import annotations


def cuda_available() -> bool:
    """The package's question, asked here (torch is imported on the first call, not with the package:
    ``megatron_rl/__init__.py`` imports :mod:`megatron_rl.compat.deferred_compile`)."""
    from megatron_rl.compat.devices import cuda_available as available

    return available()


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
