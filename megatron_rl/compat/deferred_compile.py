"""Import megatron-core without loading torch's compiler.

megatron-core decorates its fused kernels with ``torch.compile`` when its modules are imported
(``megatron.core.jit.jit_fuser`` and a few direct ``@torch.compile``); creating those wrappers
imports ``torch._dynamo`` and ``torch._inductor``, which is 2.5-3 s of every process's start
(``import megatron.core`` 4.7-5.3 s -> 2.1-2.4 s measured here), paid by each rank of every job
although most of those kernels are never called (none on the CPU path).  While a
``megatron.core`` module executes, ``torch.compile`` is replaced by :func:`_deferred`, which
returns a function that calls the real ``torch.compile`` the first time it runs: the kernels that
are used are compiled as before, at their first call, which is when ``torch.compile`` compiles
anyway.  Everything outside megatron-core's own import sees the real ``torch.compile``.  The first call
compiles with the token dimension symbolic (:func:`_token_dim_dynamic`): one compilation per
kernel where lengths vary, not two.

Installed by ``megatron_rl/__init__.py`` (a finder on ``sys.meta_path``, no torch import until
megatron-core is imported).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading

_PREFIX = "megatron.core"
_state = threading.local()


def _deferred(real):
    """``torch.compile`` that compiles at the first call of what it decorates."""

    def compile_later(model=None, **options):
        if model is None:  # @torch.compile(...) with options
            return lambda fn: compile_later(fn, **options)
        if not hasattr(model, "__code__"):
            return real(model, **options)  # modules and anything unusual: as torch does it
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
                _token_dim_dynamic(args)
            return compiled(*args, **kwargs)

        return first_call_compiles

    compile_later._megatron_rl_deferred = True
    return compile_later


def _token_dim_dynamic(args) -> None:
    """Mark the first dimension (tokens: megatron's ``[s, b, h]``) of the first call's tensors
    dynamic.  RL micro-batches and rollout steps change length at every call; left static, the
    first call compiles a graph for its length and the second recompiles it with the length
    symbolic (dynamo's automatic dynamic shapes) -- two compilations of every fused kernel on a
    cold machine, forward and backward.  Marked, the first compilation is the symbolic one and the
    only one (``maybe_``: a kernel that needs the size static still specialises)."""
    import torch

    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() >= 2:
            torch._dynamo.maybe_mark_dynamic(arg, 0)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the wrapped loader's
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        import torch

        outermost = not getattr(_state, "active", False)
        real = torch.compile
        if outermost:
            _state.active = True
            torch.compile = _deferred(real)
        try:
            self.inner.exec_module(module)
        finally:
            if outermost:
                torch.compile = real
                _state.active = False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _PREFIX and not name.startswith(_PREFIX + "."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
