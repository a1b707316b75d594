"""Workarounds for megatron-core behaviour that is wrong, missing or internal on every device.

Each is registered with the megatron-core versions it was checked against: a :class:`Patch` when
importing and applying changes megatron, a :class:`Workaround` when the code here is called (or
a value used) where it is needed.
"""

from __future__ import annotations

import torch

from megatron_rl.compat.registry import MEGATRON_TESTED, Patch, Workaround, register_patch, register_workaround


def transformer_config_fixes() -> dict:
    """Extra ``TransformerConfig`` arguments that work around megatron-core checks.

    megatron-core 0.16.1: ``TransformerConfig.__post_init__`` rejects
    ``variable_seq_lengths=True`` (needed for token-budget micro-batches through the pipeline)
    whenever ``moe_token_dispatcher_type == "allgather"`` -- its default -- even for dense models
    without experts.  The dispatcher is unused by dense models, so name the one that passes.  Its
    ``cuda_graph_scope`` default ``"full"`` warns as deprecated and is turned into ``[]``, so pass
    ``[]`` directly.
    """
    return {"moe_token_dispatcher_type": "alltoall", "cuda_graph_scope": []}


register_workaround(
    Workaround(
        name="config.moe_dispatcher_for_variable_seq_lengths",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "TransformerConfig rejects variable_seq_lengths with the default 'allgather' MoE "
            "dispatcher even for dense models; transformer_config_fixes() names 'alltoall'"
        ),
        used_in="models/builder.py:transformer_config",
    )
)
register_workaround(
    Workaround(
        name="config.cuda_graph_scope_default",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "TransformerConfig's own default cuda_graph_scope='full' warns 'full scope is deprecated' "
            "on every model build; transformer_config_fixes() passes the [] it is converted to"
        ),
        used_in="models/builder.py:transformer_config",
    )
)
register_workaround(
    Workaround(
        name="model.gptmodel_postprocess_hook",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "RLGPTModel overrides GPTModel._postprocess (private) to return hidden states so the "
            "chunked log-prob and value heads replace the output layer; checked by the model tests"
        ),
        used_in="models/gpt.py:_postprocess",
    )
)
register_workaround(
    Workaround(
        name="rope.llama3_fixed_factors",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "GPTModel(rope_scaling=True) applies Llama-3 scaling with only the factor configurable "
            "(low/high frequency factors 1/4, original length 8192 fixed in RotaryEmbedding); HF "
            "configs with other values are refused and the rollout decoder uses the same constants"
        ),
        used_in="models/arch.py:LLAMA3_ROPE_FIXED",
    )
)
register_workaround(
    Workaround(
        name="transformer.selective_recompute_needs_te",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "selective recompute of the mlp/layernorm modules needs TransformerEngine layers (and "
            "hangs with linear biases); validation refuses it for the local implementation"
        ),
        used_in="features.py:model.recompute.modules",
    )
)


def default_batch_p2p_comm(pp: int, vpp: int | None) -> bool:
    """``batch_p2p_comm`` when the config leaves it unset: off for interleaved PP=2.

    megatron-core 0.16.1: the interleaved 1F1B schedule with two pipeline ranks and batched p2p
    gives silently wrong losses and gradients; unbatched p2p is exact.
    """
    return not (pp == 2 and (vpp or 1) > 1)


register_workaround(
    Workaround(
        name="pipeline.batch_p2p_comm_pp2_vpp",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "interleaved 1F1B with PP=2 and batch_p2p_comm=True gives wrong losses and gradients; "
            "default_batch_p2p_comm() turns it off there and validation refuses it when set"
        ),
        used_in="distributed/runtime.py:ParallelLayout.from_config; features.py:parallel.batch_p2p_comm",
    )
)


def distributed_optimizer_checkpoint_metadata() -> dict:
    """The ``metadata`` for ``DistributedOptimizer.sharded_state_dict``.

    megatron-core 0.16.1: the default format (``fully_sharded_model_space``) is refused by its own
    ShardedTensor validation; ``fully_reshardable`` is accepted and also lets a run resume on
    another TP/PP/DP layout, as the plain optimizer's checkpoints do.
    """
    return {"distrib_optim_sharding_type": "fully_reshardable"}


register_workaround(
    Workaround(
        name="dist_checkpointing.fully_reshardable_optimizer",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "the DistributedOptimizer's default checkpoint format fails megatron's own ShardedTensor "
            "validation; checkpoints use distrib_optim_sharding_type='fully_reshardable'"
        ),
        used_in="engine/checkpoint.py:_part_sharded",
    )
)


def pre_normalised_count() -> torch.Tensor:
    """The token count a loss function returns with a loss already divided by its global denominator.

    megatron-core 0.16.1 with ``calculate_per_token_loss=True``: the schedule neither divides the
    loss by the number of micro-batches nor averages over data-parallel ranks; it sums the counts
    the loss functions return, and ``finalize_model_grads`` all-reduces that sum over DP x CP and
    divides every gradient by it -- only ``if num_tokens > 0``.  A count of 0 therefore leaves the
    gradients as the pre-divided losses made them.  A release that divides unconditionally would
    make them inf, and the DP/PP parity tests fail.
    """
    return torch.tensor(0, dtype=torch.int)


register_workaround(
    Workaround(
        name="finalize_model_grads.zero_count_not_rescaled",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "losses are divided by the mini-batch denominator on the host; returning count 0 relies "
            "on finalize_model_grads skipping its 1/num_tokens scaling when the summed count is 0 "
            "(internal behaviour, not a documented contract)"
        ),
        used_in="engine/forward.py:run_sequences",
    )
)


def _patch_tp_reduce() -> None:
    from megatron.core.tensor_parallel import mappings

    original = mappings._reduce
    if getattr(original, "_megatron_rl_contiguous", False):
        return

    def _reduce(input_, group):
        # The original all-reduces ``input_.contiguous()`` and returns ``input_``: hand it the
        # contiguous tensor, so the tensor it reduces is the one it returns.
        return original(input_.contiguous(), group)

    _reduce._megatron_rl_contiguous = True
    mappings._reduce = _reduce


register_patch(
    Patch(
        name="tensor_parallel.reduce_noncontiguous",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "tensor_parallel.mappings._reduce all-reduces input_.contiguous() and returns input_: "
            "for a non-contiguous tensor (e.g. the gradient of a transposed view entering "
            "copy_to_tensor_model_parallel_region) the reduced copy is dropped and each TP rank "
            "keeps its partial sum; the patch wraps _reduce to pass it a contiguous tensor"
        ),
        apply=_patch_tp_reduce,
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
        megatron_versions=MEGATRON_TESTED,
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
