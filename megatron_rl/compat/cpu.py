"""Run megatron-core's real code paths on a CPU-only PyTorch (gloo).

megatron-core assumes CUDA in a few dozen places (buffers on ``current_device()``,
``device="cuda"`` factories, ``.cuda()`` calls, CUDA RNG state, ``torch.cuda.FloatTensor`` type
strings in the optimizers).  Rather than fork those files we:

* map ``torch.cuda.current_device`` / ``synchronize`` / the CUDA RNG functions to the CPU;
* enter :class:`CudaToCpuMode` (a ``TorchFunctionMode``) in the thread that enables compat -- a
  mode holds per thread, so threads started later run without it -- which rewrites
  ``device="cuda"`` to CPU, drops ``pin_memory``, makes ``Tensor.cuda()`` the identity and
  reports CUDA type strings from ``Tensor.type()`` so megatron's dtype dispatch works;
* disable ``torch._dynamo``, so megatron's compiled fusions (and any other ``torch.compile``
  in the process) run eagerly.

Everything is enabled only when CUDA is absent (see :func:`enable_cpu_compat`), and every
rewritten megatron call site can be listed with trace mode (``MEGATRON_RL_COMPAT_TRACE=1``) --
a canary after upgrading megatron-core.

Tested with megatron-core 0.19.2 and torch 2.13 (CPU build).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.compat.registry import MEGATRON_TESTED, TORCH_TESTED, Patch, register_patch

_TYPE_STRINGS = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}

_FACTORY_DEVICE_FUNCS_WITH_POSITIONAL_DEVICE = {torch.Tensor.to, torch.Tensor.new_empty}
# Calls the mode rewrites even without keyword arguments.
_NEEDS_A_LOOK = {torch.Tensor.cuda, torch.Tensor.type} | _FACTORY_DEVICE_FUNCS_WITH_POSITIONAL_DEVICE

_lock = threading.Lock()
_trace_enabled = os.environ.get("MEGATRON_RL_COMPAT_TRACE", "0") not in ("", "0")
_trace: collections.Counter = collections.Counter()
_enabled = False
_mode: "CudaToCpuMode | None" = None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # A bare int means a CUDA ordinal to torch.
    return isinstance(device, int) and not isinstance(device, bool)


def _record(what: str) -> None:
    """Remember the first megatron frame that asked for CUDA (trace mode only)."""
    if not _trace_enabled:
        return
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "megatron" + os.sep + "core" in filename:
            short = filename.split("megatron" + os.sep, 1)[1]
            _trace[f"megatron/{short}:{frame.f_lineno} {what}"] += 1
            return
        frame = frame.f_back
    # CUDA requests from outside megatron (our code, torch) are not recorded.


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placement requests to the CPU for every torch call in this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the thread passes here: most carry no keyword and are none of the
        # calls below, and go straight through (this path is a measurable share of a small step).
        if not kwargs and func not in _NEEDS_A_LOOK:
            return func(*args)
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda:
            _record("Tensor.cuda()")
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            _record("Tensor.type() -> torch.cuda.*Tensor")
            tensor = args[0]
            return _TYPE_STRINGS.get(tensor.dtype, func(*args))
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device):
            _record(f"{getattr(func, '__name__', func)}(device=cuda)")
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            _record(f"{getattr(func, '__name__', func)}(pin_memory=True)")
            kwargs["pin_memory"] = False
        if func in _FACTORY_DEVICE_FUNCS_WITH_POSITIONAL_DEVICE and len(args) > 1:
            if _is_cuda_device(args[1]) and not isinstance(args[1], int):
                _record(f"{func.__name__}(cuda)")
                args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- CUDA stand-ins


def _distinct(fn):
    """A fresh function object: torch._dynamo keys its rules on torch.cuda functions by identity,
    so one object installed under two names breaks every later ``torch.compile``."""

    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = f"megatron_rl_cpu_{fn.__name__}"
    return wrapper


def _patch_torch_cuda() -> None:
    from megatron_rl.compat import cuda_standins

    cuda = torch.cuda
    for name, fn in cuda_standins.FUNCTIONS.items():
        setattr(cuda, name, _distinct(fn))
    for name, cls in cuda_standins.CLASSES.items():
        setattr(cuda, name, cls)
    for name in ("get_rng_state", "set_rng_state", "manual_seed"):
        setattr(cuda.random, name, getattr(cuda, name))
    cuda_standins.install_nvtx_noops()
    # megatron-core wraps small fusions in torch.compile at import; compiling C++ kernels for
    # them on CPU costs far more than it saves, so run them eagerly.  This is process-wide: a
    # user's own torch.compile runs eagerly on CPU too.
    import torch._dynamo as dynamo

    dynamo.config.disable = True


def _patch_megatron_rng() -> None:
    """megatron's private CUDA RNG helpers silently do nothing on CPU builds of torch."""
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_rl.compat.cuda_standins import get_rng_state, set_rng_state

    mrandom._get_cuda_rng_state = get_rng_state
    mrandom._set_cuda_rng_state = set_rng_state


def _patch_moe_host_copies() -> None:
    """The alltoall MoE dispatcher moves its split sizes "to the host as numpy" only when they are
    on CUDA; on the CPU they stay tensors, which ``all_to_all_single`` refuses as split sizes."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_megatron_rl_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._megatron_rl_cpu = True
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_uneven_first_dim_collectives() -> None:
    """gloo's all_gather and reduce_scatter take equal sizes only; megatron's alltoall MoE
    dispatcher with expert TP > 1 gathers (and in backward reduce-scatters) uneven token counts.
    Pad every piece to the largest, run megatron's own equal-size path, cut the padding off."""
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "_megatron_rl_cpu", False):
        return

    def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))]) if t.shape[0] < rows else t

    def _gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        most = max(sizes)
        out = gather(_pad(input_.contiguous(), most), group, None, False)
        return torch.cat([out[r * most:r * most + n] for r, n in enumerate(sizes)])

    def _reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        most = max(sizes)
        padded = torch.cat([_pad(p, most) for p in torch.split(input_, sizes, dim=0)])
        return scatter(padded, group, None, False)[:sizes[group.rank()]]

    _gather._megatron_rl_cpu = _reduce_scatter._megatron_rl_cpu = True
    mappings._gather_along_first_dim = _gather
    mappings._reduce_scatter_along_first_dim = _reduce_scatter


register_patch(
    Patch(
        name="cpu.torch_cuda_functions",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
        reason=(
            "torch.cuda.current_device/synchronize/RNG raise or no-op on CPU builds; "
            "megatron calls them in buffers, p2p, DDP, dist_checkpointing and the RNG tracker; "
            "streams, events (host clock), NVTX ranges, memory statistics and device properties "
            "get one stand-in each (compat/cuda_standins.py): DDP's grad-sync streams, the MoE "
            "alltoall dispatcher's host copies, the inference engine's step timing and suspend/resume. "
            "Also sets torch._dynamo.config.disable so megatron's compiled fusions run eagerly: "
            "every torch.compile in the process, the user's included, runs uncompiled on CPU"
        ),
        apply=_patch_torch_cuda,
        cpu_only=True,
    )
)
register_patch(
    Patch(
        name="cpu.megatron_rng_tracker",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
        reason=(
            "tensor_parallel/random.py _get/_set_cuda_rng_state use torch._C CUDA hooks; on a CPU "
            "build the setter silently does nothing, so forked RNG streams never advance"
        ),
        apply=_patch_megatron_rng,
        cpu_only=True,
    )
)
register_patch(
    Patch(
        name="cpu.cuda_to_cpu_function_mode",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
        reason=(
            "device='cuda' factories, .cuda(), pin_memory and 'torch.cuda.FloatTensor' type "
            "checks across schedules, p2p, DDP, optimizers, clip_grads, dist_checkpointing. "
            "A TorchFunctionMode holds for the thread that enters it: threads started later "
            "(e.g. checkpoint writers) run without it"
        ),
        apply=lambda: enter_cpu_mode(),
        cpu_only=True,
    )
)


register_patch(
    Patch(
        name="cpu.moe_dispatcher_host_splits",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
        reason=(
            "moe_utils.maybe_move_tensor_to_cpu(as_numpy=True) converts only CUDA tensors; the "
            "alltoall token dispatcher then hands CPU tensors to all_to_all_single as split sizes"
        ),
        apply=_patch_moe_host_copies,
        cpu_only=True,
    )
)


register_patch(
    Patch(
        name="cpu.uneven_first_dim_collectives",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
        reason=(
            "tensor_parallel/mappings.py gathers and reduce-scatters uneven first dimensions with "
            "torch.distributed.all_gather / reduce_scatter on tensor lists (the alltoall MoE "
            "dispatcher with expert TP > 1); gloo takes equal sizes only"
        ),
        apply=_patch_uneven_first_dim_collectives,
        cpu_only=True,
    )
)


def enter_cpu_mode() -> None:
    """Enter the CUDA->CPU function mode in this thread (idempotent; other threads do not get it)."""
    global _mode
    if _mode is None:
        _mode = CudaToCpuMode()
        _mode.__enter__()


def cpu_compat_trace() -> dict[str, int]:
    """Megatron call sites rewritten so far (needs ``MEGATRON_RL_COMPAT_TRACE=1``)."""
    with _lock:
        return dict(_trace)


def set_trace(enabled: bool) -> None:
    global _trace_enabled
    _trace_enabled = enabled
