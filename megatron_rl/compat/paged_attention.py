"""Which paged attention megatron-core's dynamic inference engine calls (``rollout.paged_attention``).

megatron-core 0.19's ``Attention.flash_decode_and_prefill`` calls flash-attn's
``flash_attn_varlen_func`` (prefill and mixed steps) and ``flash_attn_with_kvcache`` (decode-only
steps) with a block table, by the names ``megatron.core.transformer.attention`` imported, after
asserting flash-attn >= 2.7.3 (or FA3 / FA4).  Three implementations can stand behind those names:

* ``flash_attn`` -- flash-attn's own kernels, where they import (CUDA);
* ``triton`` -- :mod:`megatron_rl.ops.paged_attention`, one Triton kernel for both calls that reads the
  block table itself (no host synchronisation, so a CUDA graph holds it); what ``auto`` picks on CUDA
  without flash-attn.  On the CPU it runs in Triton's interpreter (for checking, not speed);
* ``sdpa`` -- :mod:`megatron_rl.compat.inference_cpu`'s SDPA over each request's pages, what ``auto``
  picks on the CPU (it reads lengths on the host, so no CUDA graph can hold it).

:func:`install_paged_attention` rebinds megatron's names when the engine is built; flash-attn's own
functions are kept and put back when ``flash_attn`` is installed again.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Callable, Optional

from megatron_rl.compat.records import MEGATRON_TESTED, Workaround, register_workaround
from megatron_rl.config.choices import AUTO, PAGED_ATTENTION, require_same

FLASH_ATTN, TRITON, SDPA = "flash_attn", "triton", "sdpa"


@dataclasses.dataclass(frozen=True)
class PagedKernels:
    """One implementation: where it runs, whether a CUDA graph can capture it, its two functions
    (``None``: flash-attn's own, as megatron imported them)."""

    name: str
    cuda_only: bool
    graph_safe: bool
    functions: Callable[[], Optional[tuple]]
    installed: Callable[[], bool]
    missing: str  # what to do when it is not installed


def _triton_functions():
    from megatron_rl.ops.paged_attention import triton_decode_paged, triton_varlen_paged

    return triton_varlen_paged, triton_decode_paged


# megatron-core's dynamic-batching attention calls flash-attn's paged kernels from this version on
# (or FlashAttention-3, under either of the module names megatron-core imports it by).
PAGED_FLASH_ATTN_MIN = "2.7.3"
_FA3_MODULES = ("flash_attn_3", "flashattn_hopper")


@functools.lru_cache(maxsize=1)
def paged_flash_attention_installed() -> bool:
    """Whether megatron's inference engine finds its paged attention kernels, read from the
    installed packages (without importing megatron-core or flash-attn)."""
    if any(importlib.util.find_spec(name) is not None for name in _FA3_MODULES):
        return True
    if importlib.util.find_spec("flash_attn") is None:
        return False
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("flash-attn")) >= Version(PAGED_FLASH_ATTN_MIN)
    except PackageNotFoundError:
        return False



def _sdpa_functions():
    from megatron_rl.compat.inference_cpu import sdpa_decode_paged, sdpa_varlen_paged

    return sdpa_varlen_paged, sdpa_decode_paged


def _flash_installed() -> bool:
    return paged_flash_attention_installed()


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


KERNELS: dict[str, PagedKernels] = {
    FLASH_ATTN: PagedKernels(FLASH_ATTN, cuda_only=True, graph_safe=True, functions=lambda: None,
                             installed=_flash_installed, missing="pip install flash-attn>=2.7.3, or set "
                             "rollout.paged_attention=auto (Triton's kernel)"),
    TRITON: PagedKernels(TRITON, cuda_only=False, graph_safe=True, functions=_triton_functions,
                         installed=_triton_installed, missing="install triton (it ships with torch's CUDA wheels)"),
    SDPA: PagedKernels(SDPA, cuda_only=False, graph_safe=False, functions=_sdpa_functions,
                       installed=lambda: True, missing=""),
}
require_same(KERNELS, PAGED_ATTENTION[1:], "rollout.paged_attention")


def pick_paged_attention(requested: str, cuda: bool) -> str:
    """``requested`` with ``auto`` resolved: flash-attn where it imports on CUDA, else Triton's
    kernel on CUDA, else the SDPA stand-in (faster than Triton's interpreter on the CPU)."""
    if requested != AUTO:
        return requested
    if cuda:
        return FLASH_ATTN if _flash_installed() else TRITON
    return SDPA


def paged_attention_reason(picked: str, cuda: bool) -> str:
    if not cuda:
        return "CPU: SDPA over the KV pages (Triton runs only in its interpreter there)"
    if picked == FLASH_ATTN:
        return "CUDA with flash-attn's paged kernels"
    return "CUDA without flash-attn: the Triton paged kernel"


def paged_attention_refusal(name: str, cuda: bool) -> str:
    """Why ``name`` cannot run on this machine ('' when it can)."""
    kernels = KERNELS[name]
    if kernels.cuda_only and not cuda:
        return f"{name} runs on CUDA only"
    if not kernels.installed():
        return f"{name} is not installed: {kernels.missing}"
    return ""


_ORIGINAL: dict[str, object] = {}
_NAMES = ("flash_attn_varlen_func", "flash_attn_with_kvcache", "is_fa_min_version", "HAVE_FA3", "HAVE_FA4")


def _fa_version_ok(*_args, **_kwargs) -> bool:
    return True


def install_paged_attention(name: str) -> None:
    """Point megatron's dynamic-batching attention at ``name``'s kernels (process-wide)."""
    from megatron.core.transformer import attention

    if not _ORIGINAL:
        _ORIGINAL.update({n: getattr(attention, n) for n in _NAMES})
    functions = KERNELS[name].functions()
    if functions is None:
        for n, value in _ORIGINAL.items():
            setattr(attention, n, value)
        return
    attention.flash_attn_varlen_func, attention.flash_attn_with_kvcache = functions
    # Only attention.py's dynamic-batching assert reads the version; FA3 / FA4, when importable,
    # would be preferred by Attention._resolve_flash_version over the names rebound here.
    attention.is_fa_min_version = _fa_version_ok
    attention.HAVE_FA3 = attention.HAVE_FA4 = False


def installed_paged_attention() -> str:
    """The implementation megatron's names point at now."""
    from megatron.core.transformer import attention

    for name, kernels in KERNELS.items():
        functions = kernels.functions()
        if functions is not None and attention.flash_attn_varlen_func is functions[0]:
            return name
    return FLASH_ATTN


register_workaround(
    Workaround(
        name="inference.paged_attention_without_flash_attn",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "with a DynamicInferenceContext Attention.forward bypasses core_attention and "
            "Attention.flash_decode_and_prefill calls flash-attn's paged flash_attn_varlen_func / "
            "flash_attn_with_kvcache (with window_size, softmax_scale, num_splits) after asserting HAVE_FA4 or "
            "HAVE_FA3 or flash-attn >= 2.7.3; without flash-attn the engine rebinds those names to the Triton "
            "paged kernel (CUDA) or SDPA over each request's pages (CPU), which compute the same full causal "
            "attention (sliding windows and sink softmax refused), and sets HAVE_FA3 / HAVE_FA4 False so "
            "Attention._resolve_flash_version keeps the rebound FA2 names"
        ),
        used_in="compat/paged_attention.py:install_paged_attention",
    )
)
