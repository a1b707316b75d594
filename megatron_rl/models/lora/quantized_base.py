"""A LoRA model's frozen base held in 8 bits (``lora.quantize_base: int8``).

The base of a LoRA run never changes, so it need not sit in bf16: each transformer layer's
projections (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) become int8 weights
with one fp32 scale per output row (symmetric, ``scale = max|row| / 127``; torchao's int8
weight-only scheme), a byte per weight instead of two.  The embedding, output layer, norms and
biases stay in the model's dtype, as QLoRA keeps them.

Each matmul dequantizes its layer's weight (:mod:`megatron_rl.models.lora.int8_weights`, one definition) to the
model's dtype and drops it after use; the backward pass dequantizes again.  Why our own autograd
function and not megatron's ``linear_with_frozen_weight``: that one saves the weight it is given
for the backward pass, which would keep every layer's dequantized copy alive from forward to
backward -- a bf16 base again, at the peak.  Here the int8 tensor is what is saved.
torchao's and bitsandbytes' quantized tensors do not go through megatron's tensor-parallel layers
(they replace ``nn.Linear``), so the layers stay megatron's and only their matmul changes.

A row-parallel layer's rows are split over TP: the row maxima are all-reduced over the TP group
first, so every layout holds the same int8 values and scales as one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_rl.layout.lora import QUANTIZED_LAYERS
from megatron_rl.models.canonical import unwrap
from megatron_rl.models.lora.int8_weights import dequantize, is_quantized

QMAX = 127


class _Int8FrozenLinear(torch.autograd.Function):
    """``input @ dequantize(q).T (+ bias)`` saving only the int8 ``q`` for the backward pass."""

    @staticmethod
    def forward(ctx, x, q, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(q)
        ctx.scale, ctx.dtype, ctx.allreduce_dgrad, ctx.tp_group = q.quant_scale, q.dequant_dtype, allreduce_dgrad, \
            tp_group
        output = torch.matmul(x, dequantize(q, q.quant_scale, q.dequant_dtype).t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        (q,) = ctx.saved_tensors
        weight = dequantize(q, ctx.scale, ctx.dtype)
        grad_input = grad_output.reshape(-1, grad_output.size(-1)).matmul(weight)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], weight.size(1))
        if ctx.allreduce_dgrad:
            dist.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


def _int8_forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,  # noqa: A002
                       sequence_parallel, tp_group=None, grad_output_buffer=None, wgrad_deferral_limit=None,
                       gtp_remat_size=1):
    """megatron's ``_forward_impl`` contract for a frozen weight (what ``linear_with_frozen_weight``
    does around its matmul: the sequence-parallel all-gather of the input), with an int8 weight."""
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    return _Int8FrozenLinear.apply(input, weight, bias, allreduce_dgrad, tp_group)


@torch.no_grad()
def quantize_linear(linear: torch.nn.Module) -> None:
    """Replace ``linear``'s frozen weight by int8 + per-row scales (no-op if it already is)."""
    weight = linear.weight
    if is_quantized(weight):
        return
    if weight.requires_grad:
        raise ValueError("only a frozen base weight can be held in int8")
    absmax = weight.detach().to(torch.float32).abs().amax(dim=1)
    if isinstance(linear, RowParallelLinear) and linear.tp_group.size() > 1:
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=linear.tp_group)  # the whole row's maximum
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    q = torch.round(weight.to(torch.float32) / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    packed = torch.nn.Parameter(q, requires_grad=False)
    for key, value in vars(weight).items():  # megatron's TP attributes (partition_dim, ...)
        setattr(packed, key, value)
    packed.quant_scale, packed.dequant_dtype = scale, weight.dtype
    linear.weight = packed
    linear.register_buffer("weight_scale", scale, persistent=False)  # counted and moved with the module
    linear._forward_impl = _int8_forward_impl


def quantize_base(chunks) -> None:
    """Hold the projections of every transformer layer of ``chunks`` in int8 (after the base's
    weights are loaded: nothing may be copied into them afterwards)."""
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            for path in QUANTIZED_LAYERS:
                try:
                    linear = layer.get_submodule(path)
                except AttributeError:
                    continue  # a mixture-of-experts layer has no dense linear_fc1 / linear_fc2
                quantize_linear(linear)
