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


def _torch_adam_distributed_optimizer() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in inner if isinstance(opt, DistributedOptimizer)]


def init_distributed_optimizer_state(optimizer) -> None:
    """Give a not-yet-stepped DistributedOptimizer (torch Adam) zero Adam state and step 0.

    megatron-core 0.16.1: without TE or Apex, ``DistributedOptimizer.state_dict()`` reads the
    ``step`` of every parameter's torch-Adam state and asserts there is exactly one value, so a
    freshly built optimizer -- the one a resumed run loads into -- cannot even describe what it
    wants to load.  Zero moments and step 0 are what Adam would start from; loading overwrites them.
    """
    if not _torch_adam_distributed_optimizer():
        return
    for dist_opt in _distributed_optimizers(optimizer):
        inner = dist_opt.optimizer
        if len(inner.state):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].update(
                    exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param),
                    step=torch.tensor(0.0),
                )


def _patch_distributed_optimizer_shared_step() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict
    if getattr(original, "_megatron_rl_unshared", False):
        return

    def load_state_dict(self, state_dict):
        original(self, state_dict)
        if _torch_adam_distributed_optimizer():
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].detach().clone()

    load_state_dict._megatron_rl_unshared = True
    DistributedOptimizer.load_state_dict = load_state_dict

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if _torch_adam_distributed_optimizer() and "step" not in tensors:
            # The reshardable loader leaves torch Adam's 'step' out of ``tensors`` (it comes from
            # the param groups), yet the setter copies every key of the destination state.
            main_param = self._get_main_param_and_optimizer_states(model_param)
            if "step" in main_param:
                tensors = dict(tensors, step=main_param["step"])
        return set_states(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states


register_patch(
    Patch(
        name="distrib_optimizer.torch_adam_resume",
        megatron_versions=">=0.16,<0.17",
        reason=(
            "without TE/Apex, DistributedOptimizer.state_dict() asserts on a fresh optimizer (no "
            "Adam 'step' yet) and load_state_dict() gives every parameter the same 'step' tensor, "
            "which torch Adam then increments once per parameter; the reshardable loader drops 'step' "
            "but its setter still copies it (KeyError); init_distributed_optimizer_state(), a "
            "per-parameter 'step' after loading and a setter that keeps 'step' make resume exact"
        ),
        apply=_patch_distributed_optimizer_shared_step,
    )
)
