"""torch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``) across the
torch releases that have it.

The packed (THD) training forward on CUDA in half precision makes one ``varlen_attn`` call per
micro-batch (:mod:`megatron_rl.ops.packed_attention`).  Its keywords changed between releases:
earlier releases take ``is_causal`` and no ``scale``; torch 2.11 (the CUDA 13 build GPU machines
ship) takes ``window_size=(-1, 0)`` for causal attention and ``scale`` but no ``enable_gqa``, and
raised ``TypeError: varlen_attn() got an unexpected keyword argument 'enable_gqa'`` at the first
GQA forward; torch 2.13 takes all three.  The call is built from the signature the installed
torch has: keys and values are repeated per query head where ``enable_gqa`` is missing, and
queries pre-scaled where ``scale`` is.  (Recorded with the compat workarounds:
``megatron_rl/compat/torch_varlen.py``.)
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

from megatron_rl.ops.attention_kernels import repeat_kv


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def varlen_call(parameters: frozenset, scale: float, head_dim: int, gqa: bool) -> tuple[dict, bool, float]:
    """For a ``varlen_attn`` taking ``parameters``: its keyword arguments for causal attention,
    whether keys and values must be repeated per query head, and the factor queries are multiplied
    by (1.0 where ``scale`` is a keyword)."""
    kwargs: dict = {}
    if "window_size" in parameters:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    q_factor = 1.0
    if "scale" in parameters:
        kwargs["scale"] = scale
    else:  # the kernel's default is 1/sqrt(d)
        q_factor = scale * math.sqrt(head_dim)
    repeat = False
    if gqa:
        if "enable_gqa" in parameters:
            kwargs["enable_gqa"] = True
        else:
            repeat = True
    return kwargs, repeat, q_factor


def causal_varlen_attention(q, k, v, offsets, longest: int, scale: float) -> torch.Tensor:
    """Causal attention of packed rows: ``q`` ``[tokens, heads, d]``, ``k``/``v`` ``[tokens,
    kv_heads, d]``, ``offsets`` the int32 sequence starts (and total) on the device."""
    from torch.nn.attention.varlen import varlen_attn

    kwargs, repeat, q_factor = varlen_call(_parameters(varlen_attn), scale, q.size(-1), q.size(1) != k.size(1))
    if repeat:
        k, v = repeat_kv(k, q), repeat_kv(v, q)
    if q_factor != 1.0:
        q = q * q_factor
    return varlen_attn(q, k, v, offsets, offsets, longest, longest, **kwargs)

