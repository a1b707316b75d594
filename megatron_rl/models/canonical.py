"""Layout-independent ("canonical") view of a model's parameters.

The canonical form of a model is a dict ``{global_name: full tensor}`` as a TP=1, PP=1 model would
hold it, with global layer numbers and the *true* vocabulary size (TP padding removed).  It is
the meeting point of every layout: tests compare gradients across layouts with it, the HF bridge
maps HF names onto it, and weights move between layouts through it.

Sharding rules, from megatron-core's own parameter attributes:

* ``tensor_model_parallel`` params are split on ``partition_dim`` across the TP group;
* the gated MLP input projection (SwiGLU) holds ``[gate_r; up_r]`` on rank r, so its canonical
  form ``[gate; up]`` is re-interleaved on gather and scatter;
* vocabulary-parallel tensors (embedding, output layer) are padded on the last TP rank;
* with tied embeddings and PP>1 the last stage's ``output_layer.weight`` is a copy of the
  embedding and is left out of the canonical dict.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


# TransformerEngine fuses the pre-attention / pre-MLP norms into the following linear layer;
# canonical names are the local spec's.
_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def global_named_parameters(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(global_name, param)`` with layer indices counted over the whole model."""
    model = unwrap(chunk)
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            _, _, idx, rest = name.split(".", 3)
            global_idx = model.decoder.layers[int(idx)].layer_number - 1
            name = f"decoder.layers.{global_idx}.{_TE_NAMES.get(rest, rest)}"
        yield name, param


def _tp_info(param: torch.Tensor) -> tuple[bool, int]:
    return bool(getattr(param, "tensor_model_parallel", False)), int(getattr(param, "partition_dim", 0))


def split_canonical(full: torch.Tensor, name: str, dim: int, local_rows: int, tp_rank: int, tp_size: int,
                    gated: bool) -> torch.Tensor:
    """TP rank ``tp_rank``'s piece of canonical ``full``, split on ``dim`` the way megatron splits it.

    Vocabulary-parallel tensors are padded to ``local_rows * tp_size`` rows first; a gated MLP
    input ``[gate; up]`` becomes ``[gate_r; up_r]``."""
    if name in VOCAB_PARALLEL:
        padded_rows = local_rows * tp_size
        if full.shape[0] < padded_rows:
            pad = full.new_zeros((padded_rows - full.shape[0], *full.shape[1:]))
            full = torch.cat([full, pad])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if gated and ".mlp.linear_fc1." in name:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
    return full.chunk(tp_size, dim=dim)[tp_rank]


def shard_for_rank(full: torch.Tensor, name: str, model, param, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The piece of canonical ``full`` that TP rank ``tp_rank`` holds for ``param``."""
    is_tp, dim = _tp_info(param)
    if not is_tp:
        return full
    return split_canonical(full, name, dim, param.shape[0], tp_rank, tp_size, model.config.gated_linear_unit)


def merge_shards(shards: list[torch.Tensor], name: str, model, param, true_vocab: int) -> torch.Tensor:
    """Inverse of :func:`shard_for_rank` over all TP ranks."""
    is_tp, dim = _tp_info(param)
    if not is_tp:
        return shards[0]
    if model.config.gated_linear_unit and ".mlp.linear_fc1." in name:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    full = torch.cat(shards, dim=dim)
    if name in VOCAB_PARALLEL:
        full = full[:true_vocab]
    return full


def _value(param: torch.nn.Parameter, attr: str) -> torch.Tensor | None:
    if attr == "param":
        return param.detach()
    if attr == "grad":
        grad = getattr(param, "main_grad", None)
        return param.grad if grad is None else grad
    raise ValueError(attr)


def gather_canonical(chunks: Iterable[torch.nn.Module], attr: str = "param") -> dict[str, torch.Tensor]:
    """Full canonical tensors (params or grads) on every rank.  For tests and small models."""
    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        model = unwrap(chunk)
        true_vocab = getattr(model, "true_vocab_size", None) or model.vocab_size
        for name, param in global_named_parameters(model):
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                continue
            value = _value(param, attr)
            if value is None:
                continue
            value = value.detach().float().clone()
            if _tp_info(param)[0] and tp_size > 1:
                shards = [torch.empty_like(value) for _ in range(tp_size)]
                dist.all_gather(shards, value, group=tp_group)
            else:
                shards = [value]
            local[name] = merge_shards(shards, name, model, param, true_vocab).cpu()
    # Pipeline stages hold different layers: exchange them.
    if ps.get_pipeline_model_parallel_world_size() > 1:
        gathered: list = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(gathered, local, group=ps.get_pipeline_model_parallel_group())
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return dict(sorted(merged.items()))
    return dict(sorted(local.items()))


@torch.no_grad()
def load_canonical(chunks: Iterable[torch.nn.Module], full: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy canonical tensors into this rank's shards (any TP/PP/VPP layout)."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
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
            piece = shard_for_rank(full[key], name, model, param, tp_rank, tp_size)
            if tuple(piece.shape) != tuple(param.shape):
                raise ValueError(f"{name}: canonical shard {tuple(piece.shape)} != parameter {tuple(param.shape)}")
            param.copy_(piece.to(param.dtype))
