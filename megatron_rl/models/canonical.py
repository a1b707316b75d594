"""Layout-independent ("canonical") view of a model's parameters.

The canonical form of a model is a dict ``{global_name: full tensor}`` as a TP=1, PP=1 model would
hold it, with global layer numbers and the *true* vocabulary size (TP padding removed).  It is
the meeting point of every layout: tests compare gradients across layouts with it, the HF bridge
maps HF names onto it, and weights move between layouts through it.

Megatron's tensor-parallel split, defined here once for every user (gather and load below, the
HF bridge's slice-wise import and export, the TP-sharded rollout engine):

* ``tensor_model_parallel`` params are split on ``partition_dim`` into contiguous blocks
  (:func:`tp_block`), one per TP rank;
* the gated MLP input projection (SwiGLU) is ``[gate; up]`` in canonical form and holds
  ``[gate_r; up_r]`` on rank r, so it is re-interleaved on gather and scatter;
* the fused QKV projection is grouped per KV group (:func:`fuse_qkv`), so a contiguous block of
  its rows is a block of whole KV groups;
* vocabulary-parallel tensors (embedding, output layer) are padded to :func:`megatron_rl.layout.arch.padded_vocab_size`
  rows, the padding on the last TP rank;
* with tied embeddings and PP>1 the last stage's ``output_layer.weight`` is a copy of the
  embedding and is left out of the canonical dict;
* routed experts (MoE) are split over expert parallelism -- rank ``e`` of the EP group holds the
  consecutive experts ``MoELayer.local_expert_indices`` -- and, inside each expert, over the
  expert tensor-parallel group with the same rule as above; canonical names carry the global
  expert number.  Shared experts follow the dense rule.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl.distributed import collectives
from megatron_rl.distributed.runtime import active_groups
from megatron_rl.layout.arch import global_expert_name, is_expert_param, local_norm_name
from megatron_rl.models.lora.int8_weights import dequantized, is_quantized

VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def global_named_parameters(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(global_name, param)`` with layer indices counted over the whole model, expert numbers
    over all EP ranks, and the local spec's norm and expert names (TE fuses the norms into the
    next linear layer and groups the experts)."""
    model = unwrap(chunk)
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            _, _, idx, rest = name.split(".", 3)
            layer = model.decoder.layers[int(idx)]
            rest = local_norm_name(rest)
            if is_expert_param(rest):
                rest = global_expert_name(rest, layer.mlp.local_expert_indices)
            name = f"decoder.layers.{layer.layer_number - 1}.{rest}"
        yield name, param


def tp_group_of(name: str):
    """``(group, rank, size)`` of the tensor-parallel split of parameter ``name``: the expert TP
    group for routed experts, the TP group otherwise."""
    if is_expert_param(name):
        group = active_groups().expt_tp
    else:
        group = active_groups().tp
    return group, group.rank(), group.size()


def _gated_fc1(name: str) -> bool:
    """The SwiGLU input projection ``[gate; up]``: of the dense MLP, a routed or a shared expert."""
    return ".linear_fc1." in name


# -- the tensor-parallel split rule -------------------------------------------------------------
def tp_block(total: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, end)`` of TP rank ``tp_rank``'s contiguous block of ``total`` rows or columns."""
    per = total // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (the vocabulary padding)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP input projection as megatron holds it: ``[gate; up]`` (per TP rank too)."""
    return torch.cat([gate, up])


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up`."""
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Separate q/k/v projections (rows of ``groups`` KV groups) -> megatron's fused QKV: per KV
    group, its query heads, then its key, then its value."""
    rest = q.shape[1:]
    per_group = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Inverse of :func:`fuse_qkv`: ``(q, k, v)`` of a fused QKV weight or bias."""
    rest = fused.shape[1:]
    per_group = heads // groups
    grouped = fused.reshape(groups, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))


def tp_shard(full: torch.Tensor, name: str, *, dim: int | None, local_rows: int, tp_rank: int,
             tp_size: int, gated: bool) -> torch.Tensor:
    """TP rank ``tp_rank``'s piece of canonical tensor ``full`` (named ``name``), split on ``dim``
    the way megatron splits it; ``dim=None`` is a replicated tensor.

    ``local_rows`` is the shard's first dimension: a vocabulary-parallel tensor is padded to
    ``local_rows * tp_size`` rows first.  A gated MLP input ``[gate; up]`` becomes ``[gate_r; up_r]``."""
    if dim is None:
        return full
    if name in VOCAB_PARALLEL:
        full = pad_rows(full, local_rows * tp_size)
        return full.chunk(tp_size, dim=0)[tp_rank]
    if gated and _gated_fc1(name):
        gate, up = split_gate_up(full)
        return fuse_gate_up(gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank])
    return full.chunk(tp_size, dim=dim)[tp_rank]


def tp_merge(shards: list[torch.Tensor], name: str, *, dim: int | None, true_vocab: int,
             gated: bool) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over all TP ranks' ``shards`` (vocabulary padding dropped)."""
    if dim is None:
        return shards[0]
    if gated and _gated_fc1(name):
        halves = [split_gate_up(s) for s in shards]
        return fuse_gate_up(torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves]))
    full = torch.cat(shards, dim=dim)
    if name in VOCAB_PARALLEL:
        full = full[:true_vocab]
    return full


def tp_split_dim(param: torch.Tensor) -> int | None:
    """The dimension megatron splits ``param`` on over TP (its own attributes); ``None`` if replicated."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(getattr(param, "partition_dim", 0))


def _value(param: torch.nn.Parameter, attr: str) -> torch.Tensor | None:
    if attr == "param":
        return dequantized(param).detach()  # an int8 base weight as the model computes with it
    if attr == "grad":
        grad = getattr(param, "main_grad", None)
        return param.grad if grad is None else grad
    raise ValueError(attr)


def gather_canonical(chunks: Iterable[torch.nn.Module], attr: str = "param",
                     select: Optional[Callable[[str], bool]] = None) -> dict[str, torch.Tensor]:
    """Full canonical tensors (params or grads) on every rank.  For tests, small models and the
    ``select`` ed few of a large one (LoRA adapters)."""
    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        model = unwrap(chunk)
        true_vocab = getattr(model, "true_vocab_size", None) or model.vocab_size
        for name, param in global_named_parameters(model):
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                continue
            if select is not None and not select(name):
                continue
            value = _value(param, attr)
            if value is None:
                continue
            value = value.detach().float().clone()
            dim = tp_split_dim(param)
            tp_group, _, tp_size = tp_group_of(name)
            if dim is not None and tp_size > 1:
                shards = [torch.empty_like(value) for _ in range(tp_size)]
                dist.all_gather(shards, value, group=tp_group)
            else:
                shards = [value]
            local[name] = tp_merge(shards, name, dim=dim, true_vocab=true_vocab,
                                   gated=model.config.gated_linear_unit).cpu()
    # Expert-parallel ranks hold different experts: exchange them.
    groups = active_groups()
    if any(is_expert_param(k) for k in local) and groups.ep.size() > 1:
        experts = {k: v for k, v in local.items() if is_expert_param(k)}
        for part in collectives.all_gather_object(experts, group=groups.ep):
            local.update(part)
    # Pipeline stages hold different layers: exchange them.
    if groups.pp.size() > 1:
        merged: dict[str, torch.Tensor] = {}
        for part in collectives.all_gather_object(local, group=groups.pp):
            merged.update(part)
        return dict(sorted(merged.items()))
    return dict(sorted(local.items()))


@torch.no_grad()
def load_canonical(chunks: Iterable[torch.nn.Module], full: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy canonical tensors into this rank's shards (any TP/PP/VPP/EP layout)."""
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in global_named_parameters(model):
            key = name
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                key = "embedding.word_embeddings.weight"
            if key not in full:
                if strict:
                    raise KeyError(f"canonical state has no tensor {key!r}")
                continue
            _, tp_rank, tp_size = tp_group_of(name)
            piece = tp_shard(full[key], name, dim=tp_split_dim(param), local_rows=param.shape[0],
                             tp_rank=tp_rank, tp_size=tp_size, gated=model.config.gated_linear_unit)
            if tuple(piece.shape) != tuple(param.shape):
                raise ValueError(f"{name}: canonical shard {tuple(piece.shape)} != parameter {tuple(param.shape)}")
            if is_quantized(param):
                raise ValueError(f"{name}: an int8 base is quantized once its weights are loaded; nothing loads "
                                 "into it afterwards")
            param.copy_(piece.to(param.dtype))
