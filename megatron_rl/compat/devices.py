"""Whether this process has real CUDA, asked without initialising it (a leaf: the compat modules
and the rest of the package ask it before anything is patched)."""

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


@functools.lru_cache(maxsize=None)
def cuda_memory_bytes() -> int | None:
    """Total memory of the first CUDA device, asked through NVML so CUDA is not initialised;
    None without CUDA or without NVML's Python bindings (pynvml)."""
    if not cuda_available():
        return None
    try:
        import pynvml  # type: ignore

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no bindings, no driver: the memory is not known
        return None
