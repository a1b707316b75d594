"""LoRA adapters on megatron's tensor-parallel linear layers.

Why our own and not a library's: peft's megatron support (``LoraParallelLinear``) puts one adapter
on a whole layer, and megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1`` -- one
adapter there is a different model from the one peft builds on HF's separate projections, and
peft could not load it back.  Megatron-Bridge's canonical LoRA splits the fused layers but needs
TransformerEngine.  Here each HF projection gets its own adapter (:mod:`megatron_rl.layout.lora`),
and the base layer stays megatron's own module: the adapter adds its output through a forward
hook, so megatron's code paths (frozen-weight linear, sequence parallelism, recompute) are
unchanged and the base parameters keep their names.

Tensor parallelism, per layer kind (``h`` = the adapter's rank-wide intermediate):

* column-parallel (q, k, v, gate, up): ``A`` replicated, ``B`` split on its rows like the base
  weight.  ``h = A x`` is the same on every TP rank; ``copy_to_tensor_model_parallel_region``
  all-reduces its gradient (each rank's ``B`` sees a slice of the output).  With sequence
  parallelism ``x`` is this rank's slice of the sequence: ``h`` is all-gathered over the sequence
  and ``A``'s gradient, a partial sum over sequence slices, is all-reduced over TP by megatron
  (``sequence_parallel`` on the parameter).
* row-parallel (o, down): ``A`` split on its columns like the base weight, ``B`` replicated.
  ``h`` is the all-reduce of every rank's partial ``A_r x_r`` (reduce-scattered over the sequence
  with sequence parallelism, ``B``'s gradient then all-reduced by megatron).

Adapters hold their weights in fp32 whatever the model's dtype (as peft computes them: the input is
cast to the adapter's dtype, the output back to the layer's), and start as peft's do: ``A`` Kaiming-
uniform, ``B`` zero, so a fresh adapter leaves the model unchanged.  ``A`` is drawn whole from a
generator seeded by (seed, layer, projection) and then cut for this rank, so every layout starts
from the same adapters.
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_rl.layout.arch import attention_dims
from megatron_rl.layout.lora import Projection, projections
from megatron_rl.models.canonical import unwrap

ADAPTER_DTYPE = torch.float32


class LoRAAdapter(torch.nn.Module):
    """One projection's adapter, in peft's names: ``lora_A.weight`` ``[rank, in]``,
    ``lora_B.weight`` ``[out, rank]`` (this TP rank's pieces)."""

    def __init__(self, in_features: int, out_features: int, rank: int, device) -> None:
        super().__init__()
        self.lora_A = torch.nn.Linear(in_features, rank, bias=False, dtype=ADAPTER_DTYPE, device=device)
        self.lora_B = torch.nn.Linear(rank, out_features, bias=False, dtype=ADAPTER_DTYPE, device=device)


class LayerAdapters(torch.nn.Module):
    """The adapters of one transformer layer, a child ``lora`` of the layer, by projection name.

    Registered as a child (not inside the base linear layers) so the layer's own state dict and
    megatron's ``sharded_state_dict`` recursion find them under ``decoder.layers.i.lora.<proj>``,
    with this module's TP split recorded for checkpoints."""

    def __init__(self, layer: torch.nn.Module, projs: tuple[Projection, ...], dims: tuple[int, int, int],
                 rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.rank, self.scaling, self.enabled = rank, alpha / rank, True
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.heads, self.kv_heads, self.head_dim = dims
        self.tp_axes: dict[str, int] = {}
        self._hooks = []
        device = next(layer.parameters()).device
        by_layer: dict[str, list[str]] = {}
        for proj in projs:
            linear = layer.get_submodule(proj.layer)
            tp = linear.tp_group.size()
            row = proj.row_parallel
            adapter = LoRAAdapter(proj.in_features // tp if row else proj.in_features,
                                  proj.out_features if row else proj.out_features // tp, rank, device)
            split, axis = (adapter.lora_A.weight, 1) if row else (adapter.lora_B.weight, 0)
            set_tensor_model_parallel_attributes(split, True, axis, 1)
            self.tp_axes[f"{proj.name}.{'lora_A' if row else 'lora_B'}.weight"] = axis
            if linear.sequence_parallel:
                # The replicated matrix sees this rank's sequence slice: megatron all-reduces its grad.
                (adapter.lora_B.weight if row else adapter.lora_A.weight).sequence_parallel = True
            self.add_module(proj.name, adapter)
            by_layer.setdefault(proj.layer, []).append(proj.name)
        self.tp_group = layer.get_submodule(projs[0].layer).tp_group
        for path, names in by_layer.items():
            linear = layer.get_submodule(path)
            hook = self._row_hook if path.endswith(("linear_proj", "linear_fc2")) else self._column_hook
            self._hooks.append(linear.register_forward_hook(_bound(hook, tuple(names), path)))

    # -- forward ------------------------------------------------------------------------------
    def _intermediate(self, x: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
        weight = torch.cat([getattr(self, n).lora_A.weight for n in names]) if len(names) > 1 \
            else getattr(self, names[0]).lora_A.weight
        return self.dropout(x.to(ADAPTER_DTYPE)) @ weight.t()

    def _column_hook(self, names, path, linear, args, output):
        if not self.enabled:
            return output
        out, bias = output
        h = self._intermediate(args[0], names)
        if linear.sequence_parallel:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=linear.tp_group)
        else:
            h = copy_to_tensor_model_parallel_region(h, group=linear.tp_group)
        deltas = {n: part @ getattr(self, n).lora_B.weight.t() for n, part in zip(names, h.split(self.rank, -1))}
        delta = self._place(deltas, path, out, linear.tp_group.size())
        return out + (delta * self.scaling).to(out.dtype), bias

    def _row_hook(self, names, path, linear, args, output):
        if not self.enabled:
            return output
        out, bias = output
        h = self._intermediate(args[0], names)
        if linear.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=linear.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=linear.tp_group)
        delta = h @ getattr(self, names[0]).lora_B.weight.t()
        return out + (delta * self.scaling).to(out.dtype), bias

    def _place(self, deltas: dict, path: str, out: torch.Tensor, tp: int) -> torch.Tensor:
        """The projections' outputs where the fused layer keeps them on this rank: per KV group
        ``[q heads, k, v]`` for ``linear_qkv``, ``[gate; up]`` for a gated ``linear_fc1``."""
        lead = out.shape[:-1]
        if path.endswith("linear_qkv"):
            groups, d = self.kv_heads // tp, self.head_dim
            widths = (("q_proj", self.heads // self.kv_heads * d), ("k_proj", d), ("v_proj", d))
            pieces = [deltas[n].reshape(*lead, groups, w) if n in deltas
                      else out.new_zeros((*lead, groups, w), dtype=ADAPTER_DTYPE) for n, w in widths]
            return torch.cat(pieces, -1).reshape(*lead, -1)
        if len(deltas) == 1 and "up_proj" in deltas and out.shape[-1] == deltas["up_proj"].shape[-1]:
            return deltas["up_proj"]  # a non-gated MLP: fc1 is up_proj alone
        half = out.shape[-1] // 2
        return torch.cat([deltas[n] if n in deltas else out.new_zeros((*lead, half), dtype=ADAPTER_DTYPE)
                          for n in ("gate_proj", "up_proj")], -1)

    # -- checkpoints ----------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The adapters as megatron ``ShardedTensor`` s, split over TP as they are held."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, self.tp_axes, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _bound(hook, names, path):
    def call(module, args, output):
        return hook(names, path, module, args, output)
    return call


def layer_adapters(chunks) -> list[LayerAdapters]:
    return [m for chunk in chunks for m in unwrap(chunk).modules() if isinstance(m, LayerAdapters)]


@torch.no_grad()
def init_adapters(adapters: LayerAdapters, layer_number: int, seed: int) -> None:
    """peft's start (A Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B = 0),
    drawn whole per (seed, layer, projection) and cut for this TP rank."""
    tp, tp_rank = adapters.tp_group.size(), adapters.tp_group.rank()
    for name, adapter in adapters.named_children():
        if not isinstance(adapter, LoRAAdapter):
            continue
        a = adapter.lora_A.weight
        row = getattr(a, "tensor_model_parallel", False)
        full_in = a.shape[1] * tp if row else a.shape[1]
        gen = torch.Generator().manual_seed(zlib.crc32(f"lora:{seed}:{layer_number}:{name}".encode()))
        full = (torch.rand((a.shape[0], full_in), generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(full_in)
        if row:
            full = full.chunk(tp, dim=1)[tp_rank]
        a.copy_(full.to(a.dtype))
        adapter.lora_B.weight.zero_()


def attach_lora(chunks, model_cfg, lora, seed: int, train_also: tuple[str, ...] = ()) -> None:
    """Adapters on every transformer layer of ``chunks`` (before megatron DDP wraps them), the base
    frozen.  ``train_also``: name prefixes that keep training (the critic's value head)."""
    projs = projections(model_cfg, lora.target_modules)
    dims = attention_dims(model_cfg)
    for chunk in chunks:
        model = unwrap(chunk)
        for param_name, param in model.named_parameters():
            if not param_name.startswith(train_also):
                param.requires_grad_(False)
        for layer in model.decoder.layers:
            layer.lora = LayerAdapters(layer, projs, dims, lora.rank, lora.alpha, lora.dropout)
            init_adapters(layer.lora, layer.layer_number - 1, seed)
        if getattr(model, "pre_process", False) and model.config.recompute_granularity == "full":
            model.embedding.register_forward_hook(_require_grad)


def attach_inference_lora(chunks, model_cfg, lora) -> None:
    """The same adapters on a model that only generates (the inference model of ``rollout.layout``,
    a generator rank's chunks): nothing there trains, and the values come with the refit."""
    attach_lora(chunks, model_cfg, lora, seed=0)
    for chunk in chunks:
        chunk.requires_grad_(False)


def _require_grad(module, args, output):
    """The frozen embedding's output, marked as needing a gradient.  megatron's full recompute is a
    reentrant checkpoint: an ``autograd.Function`` whose output needs no gradient when none of its
    inputs does -- and with the embedding frozen the first stage's hidden states need none, so every
    adapter in a recomputed layer would get no gradient at all (HF's ``enable_input_require_grads``
    for peft with gradient checkpointing)."""
    return output.requires_grad_(True) if not output.requires_grad else output


def adapter_parameters(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for chunk in chunks for n, p in unwrap(chunk).named_parameters() if ".lora." in n]


@contextlib.contextmanager
def adapters_disabled(chunks):
    """The base model: every adapter of ``chunks`` off inside the block (the LoRA reference)."""
    adapters = layer_adapters(chunks)
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield chunks
    finally:
        for a, was in zip(adapters, before):
            a.enabled = was
