"""One CPU stand-in per CUDA object megatron-core 0.19.2 touches, installed over ``torch.cuda``.

A CPU build of torch has ``torch.cuda`` but every call into the driver raises ("Torch not compiled
with CUDA enabled") or silently does nothing.  megatron-core calls it in training (buffers on
``current_device()``, streams around DDP's gradient sync and the MoE dispatcher's host copies, the
RNG tracker) and in its inference engine (CUDA events timing each step, NVTX ranges, memory
statistics in ``suspend()`` / ``resume()``, device properties when it sizes its KV cache).

CPU work runs in program order on one "stream", so the stand-ins keep the semantics that matter
there: an event records the host clock when it is recorded (``elapsed_time`` in milliseconds, like
CUDA's) and is complete at once; waiting on an event or a stream returns at once; every stream is
the one default stream.  Memory statistics report zeros (they are CUDA-allocator figures; the CPU
process's memory is measured with psutil in ``megatron_rl.distributed.metrics``).  Device
properties describe the host (its memory, no multiprocessors).

Each object has one definition here; :mod:`megatron_rl.compat.cpu` installs them all in one patch,
so no two stand-ins compete by import order.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import time
from typing import Any

import torch


class CpuEvent:
    """``torch.cuda.Event`` on the host clock: recorded when ``record`` runs, complete at once."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 external: bool = False):
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: "CpuEvent") -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._t - self._t) * 1e3


class CpuStream:
    """``torch.cuda.Stream``: CPU work is already in program order, so every wait returns at once."""

    def __init__(self, device: Any = None, priority: int = 0, **_kwargs):
        self.priority = priority
        self.device = torch.device("cpu")

    def wait_stream(self, _other: Any) -> None:
        return None

    def wait_event(self, _event: Any) -> None:
        return None

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *_exc) -> None:
        return None

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)


DEFAULT_STREAM = CpuStream()


def current_stream(_device: Any = None) -> CpuStream:
    return DEFAULT_STREAM


def stream(_stream: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext(_stream)


def current_device() -> torch.device:
    return torch.device("cpu")


def noop(*_args, **_kwargs) -> None:
    return None


def zero(*_args, **_kwargs) -> int:
    return 0


def memory_stats(*_args, **_kwargs) -> collections.defaultdict:
    """Read with ``[...]`` keys (``'allocated_bytes.all.current'``) by the inference engine."""
    return collections.defaultdict(int)


def memory_snapshot(*_args, **_kwargs) -> list:
    return []


def mem_get_info(*_args, **_kwargs) -> tuple[int, int]:
    """(free, total) bytes of the host's memory: what a CPU process can still allocate."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


class CpuDeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports, for the host."""

    def __init__(self):
        free, total = mem_get_info()
        self.name = "cpu"
        self.total_memory = total
        self.multi_processor_count = 0
        self.major, self.minor = 0, 0


def get_device_properties(_device: Any = None) -> CpuDeviceProperties:
    return CpuDeviceProperties()


def get_device_capability(_device: Any = None) -> tuple[int, int]:
    return (0, 0)


def get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. this function.
    torch.default_generator.manual_seed(int(seed))


# name in torch.cuda -> stand-in.  Functions are installed as distinct objects (see cpu.py).
FUNCTIONS = {
    "current_device": current_device,
    "synchronize": noop,
    "get_rng_state": get_rng_state,
    "set_rng_state": set_rng_state,
    "manual_seed": manual_seed,
    "manual_seed_all": manual_seed,
    "empty_cache": noop,
    "set_device": noop,
    "memory_allocated": zero,
    "max_memory_allocated": zero,
    "memory_reserved": zero,
    "max_memory_reserved": zero,
    "reset_peak_memory_stats": noop,
    "memory_stats": memory_stats,
    "memory_snapshot": memory_snapshot,
    "mem_get_info": mem_get_info,
    "get_device_properties": get_device_properties,
    "get_device_capability": get_device_capability,
    "current_stream": current_stream,
    "default_stream": current_stream,
    "set_stream": noop,
    "stream": stream,
}
CLASSES = {"Event": CpuEvent, "Stream": CpuStream}
NVTX = ("range_push", "range_pop", "mark")
# Modules that import NVTX functions by name at import time, so rebinding torch.cuda.nvtx misses them
# (megatron-core 0.19.2: the text generation controller, which pushes ranges around every step).
NVTX_IMPORTERS = ("megatron.core.inference.text_generation_controllers.text_generation_controller",)


def install_nvtx_noops() -> None:
    """NVTX ranges raise 'NVTX functions not installed' on a CPU build; no-ops instead."""
    from torch.cuda import nvtx

    for name in NVTX:
        setattr(nvtx, name, noop)
    for module_name in NVTX_IMPORTERS:
        module = sys.modules.get(module_name)
        if module is not None:
            for name in NVTX:
                if hasattr(module, name):
                    setattr(module, name, noop)
