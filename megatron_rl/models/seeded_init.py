"""Random initial weights that depend on the seed only, not on the layout.

megatron-core draws each rank's shard from that rank's generator (seeded per pipeline stage, and
per tensor-parallel rank on the GPU), so the same ``run.seed`` gives different weights on TP2,
PP2 or EP2 than on one process, and a run from random init is not reproducible across layouts
although every layout computes the same function.  Here every tensor is drawn whole, in its
canonical (one-process) form, from a generator seeded by ``run.seed`` and the tensor's global
name, and each rank keeps its shard (:func:`megatron_rl.models.canonical.load_canonical`).  The
draws are made on the CPU, so a GPU run starts from the same weights as a CPU run.

The distributions are megatron-core's own: tensors megatron initialises to a constant (norm
weights, biases, the value head) keep the value megatron gave them, which is the same on every
layout; the others are normal with megatron's standard deviations -- ``init_method_std``, scaled by
``1/sqrt(2 * num_layers)`` for the projections that write into the residual stream
(``linear_proj``, ``linear_fc2``; megatron's ``output_layer_init_method``), and
``embedding_init_method_std`` for the word embeddings.  A test compares each tensor's spread
with megatron's one-process initialisation.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Iterable, Iterator

import torch

from megatron_rl.layout.lora import is_adapter_param
from megatron_rl.models.canonical import (
    VOCAB_PARALLEL,
    global_named_parameters,
    load_canonical,
    tp_group_of,
    tp_split_dim,
    unwrap,
)

# Projections megatron initialises with ``output_layer_init_method`` (dense, shared and routed experts).
RESIDUAL_WRITERS = (".linear_proj.weight", ".linear_fc2.weight")
EMBEDDING = "embedding.word_embeddings.weight"


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def init_std(name: str, config) -> float:
    """megatron-core's standard deviation for the random tensor ``name`` (a global name)."""
    if name == EMBEDDING:
        return float(getattr(config, "embedding_init_method_std", None) or config.init_method_std)
    if name.endswith(RESIDUAL_WRITERS):
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return float(config.init_method_std)


def _constant(param: torch.Tensor) -> bool:
    flat = param.detach().reshape(-1)
    return bool(flat.numel() == 0 or torch.equal(flat, flat[:1].expand_as(flat)))


class _SeededTensors(Mapping):
    """The canonical tensors of a seeded initialisation, drawn when :func:`load_canonical` asks
    for them (one full tensor at a time, never the whole model)."""

    def __init__(self, seed: int, shapes: dict[str, tuple[int, ...]], stds: dict[str, float]):
        self.seed, self.shapes, self.stds = seed, shapes, stds

    def __getitem__(self, name: str) -> torch.Tensor:
        generator = _generator(self.seed, name)
        return torch.empty(self.shapes[name]).normal_(0.0, self.stds[name], generator=generator)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


@torch.no_grad()
def seeded_init(chunks: Iterable[torch.nn.Module], seed: int) -> None:
    """Redraw every random weight of ``chunks`` (megatron-initialised, any layout) from ``seed``
    and its global name, so every layout holds the same model.  Every rank must call (no
    communication)."""
    chunks = list(chunks)
    shapes: dict[str, tuple[int, ...]] = {}
    stds: dict[str, float] = {}
    for chunk in chunks:
        model = unwrap(chunk)
        true_vocab = getattr(model, "true_vocab_size", None) or model.vocab_size
        for name, param in global_named_parameters(model):
            if _constant(param) or is_adapter_param(name):
                continue  # LoRA adapters keep peft's start (models/lora/adapters.py)
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                name = EMBEDDING  # the last stage's copy of the tied embedding gets the embedding's draw
            shape = list(param.shape)
            dim = tp_split_dim(param)
            if dim is not None:
                shape[dim] *= tp_group_of(name)[2]
            if name in VOCAB_PARALLEL:
                shape[0] = true_vocab
            shapes[name] = tuple(shape)
            stds[name] = init_std(name, model.config)
    load_canonical(chunks, _SeededTensors(seed, shapes, stds), strict=False)
