"""What a model built for training switches while it generates, and back after: a one-rank
context-parallel group, sequence parallelism off, megatron's caches made while generating dropped."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_rl.distributed.runtime import one_rank_group


def kv_cache_bytes_for(budget: float, device: torch.device) -> int:
    """``rollout.kv_cache_memory`` in bytes: a fraction of the memory free now when <= 1, else bytes."""
    if budget > 1:
        return int(budget)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # What torch's caching allocator holds unused is free to this process too.
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return int(budget * free)


@contextlib.contextmanager
def without_context_parallel(model: torch.nn.Module, cp_group):
    """Let a model built for CP > 1 run whole sequences: every reference to ``cp_group`` in its
    modules (RoPE's slicing, attention's THD RoPE) points at a one-rank group meanwhile."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        yield
        return
    solo = one_rank_group()
    swapped: list[tuple[object, str]] = []
    seen: set[int] = set()
    for module in model.modules():
        for holder in (module, getattr(module, "pg_collection", None)):
            if holder is None or id(holder) in seen:
                continue
            seen.add(id(holder))
            for attr in ("cp_group", "cp"):
                if getattr(holder, attr, None) is cp_group:
                    setattr(holder, attr, solo)
                    swapped.append((holder, attr))
    clear_rope_cache()  # tables cached for the CP group are cut to this rank's slice
    try:
        yield
    finally:
        for holder, attr in swapped:
            setattr(holder, attr, cp_group)


@contextlib.contextmanager
def without_sequence_parallel(model: torch.nn.Module):
    """Let a model built with sequence parallelism run megatron's static batching, which has none
    (a decode step's one token cannot be split over the TP group): every rank of the group runs the
    whole sequence meanwhile.  The math is the same -- sequence parallelism only moves where the
    activations outside attention and the MLP are split -- so the switch is the flags megatron reads
    when it forwards: the config's, each parallel linear layer's, the embedding's scatter."""
    config = getattr(model, "config", None)
    if config is None or not config.sequence_parallel:
        yield
        return
    flipped: list[tuple[object, str]] = [(config, "sequence_parallel")]
    for module in model.modules():
        for attr in ("sequence_parallel", "reduce_scatter_embeddings"):
            if getattr(module, attr, None) is True:
                flipped.append((module, attr))
    for holder, attr in flipped:
        setattr(holder, attr, False)
    try:
        yield
    finally:
        for holder, attr in flipped:
            setattr(holder, attr, True)


def clear_rope_cache() -> None:
    """RoPE tables are cached per module and group: those made while generating (inference mode, a
    one-rank CP group) must not be reused by training."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    RotaryEmbedding.forward.cache_clear()
    YarnRotaryEmbedding.forward.cache_clear()  # its own cache (YaRN models)


def after_generating(model: torch.nn.Module, was_training: bool) -> None:
    """The model as training left it: its mode, and none of megatron's caches made meanwhile."""
    from megatron_rl.compat.inference_hooks import drop_inference_buffers

    model.train(was_training)
    clear_rope_cache()  # its tables were made in inference mode: training must not reuse them
    drop_inference_buffers()  # the same for megatron's scratch buffers
