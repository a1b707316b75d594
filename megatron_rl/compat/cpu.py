"""Run megatron-core's real code paths on a CPU-only PyTorch (gloo).

megatron-core assumes CUDA in a few dozen places (buffers on ``current_device()``,
``device="cuda"`` factories, ``.cuda()`` calls, CUDA RNG state, ``torch.cuda.FloatTensor`` type
strings in the optimizers).  Rather than fork those files we:

* map ``torch.cuda.current_device`` / ``synchronize`` / the CUDA RNG functions to the CPU;
* wrap the torch functions that take a device (:func:`_patch_cuda_placement`): they rewrite
  ``device="cuda"`` to CPU and drop ``pin_memory``; ``Tensor.cuda()`` is the identity and
  ``Tensor.type()`` reports CUDA type strings so megatron's dtype dispatch works;
* disable ``torch._dynamo``, so megatron's compiled fusions (and any other ``torch.compile``
  in the process) run eagerly.

Everything is enabled only when CUDA is absent (see :func:`enable_cpu_compat`), and every
rewritten megatron call site can be listed with trace mode (``MEGATRON_RL_COMPAT_TRACE=1``) --
a canary after upgrading megatron-core.

Tested with megatron-core 0.19.2 and torch 2.13 (CPU build).
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
from typing import Any

import torch

from megatron_rl.compat.records import MEGATRON_TESTED, TORCH_TESTED, Patch, register_patch

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

_lock = threading.Lock()
_trace_enabled = os.environ.get("MEGATRON_RL_COMPAT_TRACE", "0") not in ("", "0")
_trace: collections.Counter = collections.Counter()
_enabled = False


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


def _placement_kwargs(name: str, kwargs: dict) -> dict:
    """``kwargs`` with a CUDA ``device`` moved to the CPU and ``pin_memory`` dropped."""
    device = kwargs.get("device")
    if device is not None and _is_cuda_device(device):
        _record(f"{name}(device=cuda)")
        kwargs = {**kwargs, "device": "cpu"}
    if kwargs.get("pin_memory"):
        _record(f"{name}(pin_memory=True)")
        kwargs = {**kwargs, "pin_memory": False}
    return kwargs


def _on_cpu(name: str, fn):
    """``fn`` with CUDA placement requests in its keyword arguments rewritten to the CPU.  Calls
    without keywords (most of them) pay one ``if``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if kwargs:
            kwargs = _placement_kwargs(name, kwargs)
        return fn(*args, **kwargs)

    wrapper._megatron_rl_cpu_original = fn
    return wrapper


def _tensor_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)) and _is_cuda_device(args[0]):
            _record("Tensor.to(cuda)")
            args = ("cpu", *args[1:])
        if kwargs:
            kwargs = _placement_kwargs("Tensor.to", kwargs)
        return original(self, *args, **kwargs)

    to._megatron_rl_cpu_original = original
    return to


def _tensor_cuda(original):
    @functools.wraps(original)
    def cuda(self, *args, **kwargs):
        _record("Tensor.cuda()")
        return self

    cuda._megatron_rl_cpu_original = original
    return cuda


def _tensor_type(original):
    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        if not args and not kwargs:  # the type string: megatron's optimizers dispatch on CUDA names
            _record("Tensor.type() -> torch.cuda.*Tensor")
            return _TYPE_STRINGS.get(self.dtype) or original(self)
        return original(self, *args, **kwargs)

    type_._megatron_rl_cpu_original = original
    return type_


def _patch_cuda_placement() -> None:
    """Rewrite CUDA placement requests to the CPU in the torch functions that take them.

    Only the calls that can ask for a device are wrapped (factories, ``Tensor.new_*``,
    ``Tensor.to``, ``Tensor.cuda``, ``Tensor.type``); every other torch op runs untouched.  A
    ``TorchFunctionMode`` would catch the same requests with no list to keep, but it runs Python on
    every torch call of its thread: about 1.4 us each, some 10k calls (14 ms) per step of a small
    model.  The lists are every public ``torch`` function and ``Tensor`` method whose ATen schema
    has a ``device`` or ``pin_memory`` argument (``tests/test_compat.py`` checks they still are).
    Process-wide: no thread on a machine without CUDA can use a CUDA placement anyway."""
    if getattr(torch.zeros, "_megatron_rl_cpu_original", None) is not None:
        return
    for name in TORCH_FACTORIES:
        setattr(torch, name, _on_cpu(name, getattr(torch, name)))
    for name in TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _on_cpu(f"Tensor.{name}", getattr(torch.Tensor, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.cuda = _tensor_cuda(torch.Tensor.cuda)
    torch.Tensor.type = _tensor_type(torch.Tensor.type)


# torch functions and Tensor methods whose ATen schema takes `device` or `pin_memory` (torch 2.13;
# `torch.Generator` is a class and is left alone; `tensor`, `asarray` have no ATen schema).
TORCH_FACTORIES = (
    "arange", "as_tensor", "asarray", "bartlett_window", "blackman_window", "empty", "empty_like",
    "empty_permuted", "empty_strided", "eye", "full", "full_like", "hamming_window", "hann_window",
    "kaiser_window", "linspace", "logspace", "normal", "ones", "ones_like", "rand", "rand_like", "randint",
    "randint_like", "randn", "randn_like", "randperm", "range", "scalar_tensor", "sparse_coo_tensor",
    "tensor", "tril_indices", "triu_indices", "zeros", "zeros_like",
)
TENSOR_FACTORIES = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros")


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
        name="cpu.cuda_placement_to_cpu",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
        reason=(
            "device='cuda' factories, .cuda(), pin_memory and 'torch.cuda.FloatTensor' type "
            "checks across schedules, p2p, DDP, optimizers, clip_grads, dist_checkpointing; "
            "only the torch calls that take a device are wrapped, the rest run untouched"
        ),
        apply=_patch_cuda_placement,
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


def cpu_compat_trace() -> dict[str, int]:
    """Megatron call sites rewritten so far (needs ``MEGATRON_RL_COMPAT_TRACE=1``)."""
    with _lock:
        return dict(_trace)


def set_trace(enabled: bool) -> None:
    global _trace_enabled
    _trace_enabled = enabled
