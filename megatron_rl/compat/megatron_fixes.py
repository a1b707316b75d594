"""Workarounds for megatron-core behaviour that is wrong or missing on every device.

Each is registered with the megatron-core versions it was checked against.
"""

from __future__ import annotations

import torch

from megatron_rl.compat.registry import Patch, register_patch


def transformer_config_fixes() -> dict:
    """Extra ``TransformerConfig`` arguments that work around megatron-core checks.

    megatron-core 0.16.1: ``TransformerConfig.__post_init__`` rejects
    ``variable_seq_lengths=True`` (needed for token-budget micro-batches through the pipeline)
    whenever ``moe_token_dispatcher_type == "allgather"`` -- its default -- even for dense models
    without experts.  The dispatcher is unused by dense models, so name the one that passes.
    """
    return {"moe_token_dispatcher_type": "alltoall"}


register_patch(
    Patch(
        name="config.moe_dispatcher_for_variable_seq_lengths",
        megatron_versions=">=0.16,<0.17",
        reason=(
            "TransformerConfig rejects variable_seq_lengths with the default 'allgather' MoE "
            "dispatcher even for dense models; transformer_config_fixes() names 'alltoall'"
        ),
        apply=lambda: None,
    )
)
register_patch(
    Patch(
        name="model.gptmodel_postprocess_hook",
        megatron_versions=">=0.16,<0.18",
        reason=(
            "RLGPTModel overrides GPTModel._postprocess (private) to return hidden states so the "
            "chunked log-prob and value heads replace the output layer; checked by the model tests"
        ),
        apply=lambda: None,
    )
)


def _patch_tp_reduce() -> None:
    from megatron.core.tensor_parallel import mappings

    def _reduce(input_, group):
        assert group is not None, "group should not be None"
        if group.size() == 1:
            return input_
        if not input_.is_contiguous():
            input_ = input_.contiguous()
        torch.distributed.all_reduce(input_, group=group)
        return input_

    mappings._reduce = _reduce


register_patch(
    Patch(
        name="tensor_parallel.reduce_noncontiguous",
        megatron_versions=">=0.16,<0.18",
        reason=(
            "tensor_parallel.mappings._reduce all-reduces input_.contiguous() and returns input_: "
            "for a non-contiguous tensor (e.g. the gradient of a transposed view entering "
            "copy_to_tensor_model_parallel_region) the reduced copy is dropped and each TP rank "
            "keeps its partial sum"
        ),
        apply=_patch_tp_reduce,
    )
)


def release_group_caches() -> None:
    """Drop megatron-core caches that keep process groups alive after their layout is gone.

    megatron-core 0.16.1: ``RotaryEmbedding.forward`` (and the YaRN variant) is wrapped in a
    class-level ``functools.lru_cache`` keyed on ``self`` and ``cp_group``, so up to 32 modules and
    their context-parallel groups outlive the model.  A destroyed gloo group whose backend is still
    referenced keeps its three threads polling closed sockets; rebuilding layouts (the test pool,
    elastic restarts) then piles up hundreds of busy threads.  Modules freed by the cache may sit in
    reference cycles, so collect them before the groups are destroyed.
    """
    import gc

    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    for cls in (rotary_pos_embedding.RotaryEmbedding, yarn_rotary_pos_embedding.YarnRotaryEmbedding):
        clear = getattr(cls.forward, "cache_clear", None)
        if clear is not None:
            clear()
    gc.collect()


register_patch(
    Patch(
        name="parallel_state.release_group_caches",
        megatron_versions=">=0.16,<0.18",
        reason=(
            "RotaryEmbedding.forward is lru_cached on self and cp_group; the cache keeps destroyed "
            "process groups (and their gloo threads) alive; release_group_caches() clears it before "
            "a layout is torn down"
        ),
        apply=lambda: None,
    )
)
