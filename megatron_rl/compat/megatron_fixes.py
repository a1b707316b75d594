"""Workarounds for megatron-core behaviour that is wrong, missing or internal on every device.

Each is registered with the megatron-core versions it was checked against: a :class:`Patch` when
importing and applying changes megatron, a :class:`Workaround` when the code here is called (or
a value used) where it is needed.
"""

from __future__ import annotations

import torch

from megatron_rl.compat.records import MEGATRON_TESTED, Patch, Workaround, register_patch, register_workaround


def transformer_config_fixes() -> dict:
    """Extra ``TransformerConfig`` arguments that work around megatron-core checks.

    megatron-core 0.19.2: ``TransformerConfig.__post_init__`` rejects
    ``variable_seq_lengths=True`` (needed for token-budget micro-batches through the pipeline)
    whenever ``moe_token_dispatcher_type == "allgather"`` -- its default -- even for dense models
    without experts.  The dispatcher is unused by dense models, so name the one that passes.  Its
    ``cuda_graph_modules`` default ``"full"`` warns "full scope is deprecated" on every build (and
    the older ``cuda_graph_scope`` warns as deprecated when passed at all); ``[]`` is the one value
    that warns nothing and, like the default without ``cuda_graph_impl``, captures no graphs.
    """
    return {"moe_token_dispatcher_type": "alltoall", "cuda_graph_modules": []}


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
        name="config.cuda_graph_modules_default",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "TransformerConfig's default cuda_graph_modules='full' warns 'full scope is deprecated' on "
            "every model build (transformer_config.py __post_init__); transformer_config_fixes() passes "
            "[], which warns nothing and captures nothing"
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
            "configs with other values are refused"
        ),
        used_in="layout/arch.py:LLAMA3_ROPE_FIXED",
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
        used_in="features/memory.py:model.recompute.modules",
    )
)


def default_batch_p2p_comm(pp: int, vpp: int | None) -> bool:
    """``batch_p2p_comm`` when the config leaves it unset: off for interleaved PP=2.

    megatron-core 0.19.2: the interleaved 1F1B schedule with two pipeline ranks and batched p2p
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
        used_in="layout/sizes.py:ParallelLayout.from_config; features/layouts.py:parallel.batch_p2p_comm",
    )
)


def distributed_optimizer_checkpoint_metadata() -> dict:
    """The ``metadata`` for ``DistributedOptimizer.sharded_state_dict``.

    megatron-core 0.19.2: the default format (``fully_sharded_model_space``) is refused by its own
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

    megatron-core 0.19.2 with ``calculate_per_token_loss=True``: the schedule neither divides the
    loss by the number of micro-batches nor averages over data-parallel ranks; it sums the counts
    the loss functions return, and ``finalize_model_grads`` all-reduces that sum over DP x CP and
    multiplies every gradient by ``1 / clamp(num_tokens, min=1)``.  A count of 0 therefore scales by
    exactly 1 and leaves the gradients as the pre-divided losses made them.  (0.16 skipped the
    scaling when the count was 0, to the same effect.)  A release that divided by the raw count
    would make them inf, and the DP/PP parity tests fail.
    """
    return torch.tensor(0, dtype=torch.int)


register_workaround(
    Workaround(
        name="finalize_model_grads.zero_count_not_rescaled",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "losses are divided by the mini-batch denominator on the host; returning count 0 relies "
            "on finalize_model_grads scaling by 1/clamp(num_tokens, min=1), i.e. by 1 when the summed "
            "count is 0 (internal behaviour, not a documented contract)"
        ),
        used_in="engine/forward.py:run_sequences",
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

    megatron-core 0.19.2: without TE or Apex, ``DistributedOptimizer.state_dict()`` reads the
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


def _optimizer_ids_to_sharded_params(optimizer, packed_groups: list, model_sharded_state_dict) -> dict:
    """Optimizer state id -> the model's sharded tensor, for every parameter the optimizer steps.

    ``packed_groups`` are the ``param_groups`` of ``optimizer.optimizer.state_dict()``: their ids
    follow the torch optimizer's own order, in which an fp32 copy stands for its float16 parameter
    and an fp32 parameter for itself."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    groups = zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
    model_of_main = {id(main): model for models, mains in groups for model, main in zip(models, mains)}
    id_of_model = {}
    for group, packed in zip(optimizer.optimizer.param_groups, packed_groups):
        for param, param_id in zip(group["params"], packed["params"]):
            id_of_model.setdefault(id(model_of_main.get(id(param), param)), param_id)
    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {id_of_model[id(t.data)]: t for t in nested_values(tensors) if id(t.data) in id_of_model}


def _patch_float16_optimizer_mixed_dtype_checkpoint() -> None:
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor, optim_state_to_sharding_state
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if getattr(Float16OptimizerWithFloat16Params.sharded_state_dict, "_megatron_rl_mixed_dtypes", False):
        return

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state_dict = self.state_dict()
        packed = state_dict["optimizer"]["param_groups"]
        id_map = _optimizer_ids_to_sharded_params(self, packed, model_sharded_state_dict)
        id_of_main = {id(p): i for group, pg in zip(self.optimizer.param_groups, packed)
                      for p, i in zip(group["params"], pg["params"])}
        state_dict["fp32_from_fp16_params"] = [
            [make_sharded_optimizer_tensor(id_map[id_of_main[id(main)]], main, prefix="optimizer.state.fp32_param")
             for main in mains]
            for mains in state_dict["fp32_from_fp16_params"]
        ]
        step = self._extract_common_per_param_step(state_dict["optimizer"])
        optim_state_to_sharding_state(state_dict["optimizer"], id_map, exclude_keys="step")
        if step:
            state_dict["optimizer"]["state"]["common_step"] = step
        return state_dict

    sharded_state_dict._megatron_rl_mixed_dtypes = True
    Float16OptimizerWithFloat16Params.sharded_state_dict = sharded_state_dict


register_patch(
    Patch(
        name="float16_optimizer.mixed_dtype_checkpoint",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "Float16OptimizerWithFloat16Params.sharded_state_dict numbers the model's parameters over "
            "its float16 ones only, while the optimizer state numbers every parameter; with an fp32 "
            "parameter next to bf16 ones (the critic's value head) the ids disagree and saving raises "
            "KeyError, and fp32 copies would be paired with the wrong parameters; the patch maps ids "
            "through the optimizer's own parameter order"
        ),
        apply=_patch_float16_optimizer_mixed_dtype_checkpoint,
    )
)


def _patch_distributed_optimizer_mixed_dtype_order() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__init__
    if getattr(original, "_megatron_rl_mixed_dtypes", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "is_stub_optimizer", False) or not hasattr(self, "model_fp32_groups"):
            return
        # The optimizer's groups hold [fp32 shards..., shards of float16 params...] (see
        # _build_model_and_main_param_groups); index every model parameter by that order.
        for index, (fp32, float16) in enumerate(zip(self.model_fp32_groups, self.model_float16_groups)):
            for order, param in enumerate([*fp32, *float16]):
                self.model_param_group_index_map[param] = (index, order)

    __init__._megatron_rl_mixed_dtypes = True
    DistributedOptimizer.__init__ = __init__


register_patch(
    Patch(
        name="distrib_optimizer.mixed_dtype_param_order",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "DistributedOptimizer indexes each model parameter by its position in the gradient "
            "buffers, but its optimizer groups put fp32 parameters before float16 ones; with both "
            "in a group (the critic's fp32 value head next to bf16 weights) checkpoint save/load "
            "reads and writes another parameter's Adam state (a shape error, or silently wrong "
            "state); the patch re-indexes by the optimizer's own order after construction"
        ),
        apply=_patch_distributed_optimizer_mixed_dtype_order,
    )
)


register_workaround(
    Workaround(
        name="package_info.no_vcs_version",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "megatron/core/package_info.py appends `git rev-parse --short HEAD` of its install directory "
            "to __version__ unless NO_VCS_VERSION=1; in a .venv inside a git checkout that is the "
            "checkout's commit, so megatron-core reported '0.19.2+<our commit>'"
        ),
        used_in="__init__.py:NO_VCS_VERSION",
    )
)


register_workaround(
    Workaround(
        name="import.deferred_torch_compile",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "megatron.core.jit.jit_fuser is torch.compile and wraps the fused kernels while megatron-core "
            "is imported, which loads torch._dynamo and torch._inductor: 2.5-3 s of every process's start "
            "for kernels the CPU path never calls; while megatron.core modules execute, torch.compile "
            "makes wrappers that compile at their first call, with the token dimension symbolic (RL "
            "lengths vary; dynamo would compile a static graph, then recompile it dynamic at the second length)"
        ),
        used_in="compat/deferred_compile.py:_deferred; __init__.py:install",
    )
)


def _shapes_in_pairing_order(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """megatron's ``P2PCommunicator._communicate_shapes`` with the ops posted forward direction
    first (send next, receive previous), then backward (send previous, receive next).

    With two pipeline ranks and virtual stages a rank's previous and next rank are the same peer,
    so two shapes can travel to it in one call.  megatron posts them backward-first (send previous,
    then send next) while the peer posts its receives forward-first (receive previous, then
    receive next); messages between a pair match in posting order, so each side took the other's
    shape and the tensor exchange that followed failed on unequal micro-batch lengths.  The order
    here is the one megatron's own unbatched tensor exchange (``_p2p_ops``) uses."""
    device = torch.cuda.current_device()
    dist = torch.distributed

    def shape_of(t):
        return None if t is None else torch.tensor(t.size(), device=device, dtype=torch.int64)

    recv_prev_shape = torch.empty((3,), device=device, dtype=torch.int64) if recv_prev else None
    recv_next_shape = torch.empty((3,), device=device, dtype=torch.int64) if recv_next else None
    send_next_shape, send_prev_shape = shape_of(tensor_send_next), shape_of(tensor_send_prev)
    if self.config.use_ring_exchange_p2p:
        dist.ring_exchange(tensor_send_prev=send_prev_shape, tensor_recv_prev=recv_prev_shape,
                           tensor_send_next=send_next_shape, tensor_recv_next=recv_next_shape, group=self.pp_group)
    else:
        ops = [dist.P2POp(op, t, peer, self.pp_group) for op, t, peer in (
            (dist.isend, send_next_shape, self.next_rank), (dist.irecv, recv_prev_shape, self.prev_rank),
            (dist.isend, send_prev_shape, self.prev_rank), (dist.irecv, recv_next_shape, self.next_rank),
        ) if t is not None]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            torch.cuda.synchronize()  # as megatron: batch_isend_irecv's race on CUDA
    return (recv_prev_shape.tolist() if recv_prev_shape is not None else [0, 0, 0],
            recv_next_shape.tolist() if recv_next_shape is not None else [0, 0, 0])


def _patch_shape_exchange_order() -> None:
    from megatron.core.pipeline_parallel import p2p_communication

    p2p_communication.P2PCommunicator._communicate_shapes = _shapes_in_pairing_order


register_patch(
    Patch(
        name="pipeline.shape_exchange_order_pp2_vpp",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "p2p_communication.P2PCommunicator._communicate_shapes posts send-previous before "
            "send-next; with PP=2 and virtual stages both go to the same peer, which receives "
            "forward-first, so micro-batches of unequal lengths swapped shapes and the tensor "
            "exchange failed"
        ),
        apply=_patch_shape_exchange_order,
    )
)


def _keep_write_results_in_process() -> None:
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


register_patch(
    Patch(
        name="dist_checkpointing.in_process_write_results",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "FileSystemWriterAsync hands every save's write results through a multiprocessing Manager "
            "queue created with 'spawn' even when the save is synchronous; its server process imports "
            "torch when the first results arrive (4-5 s per rank, 10 s for the first save of four ranks "
            "on two cores) and stays alive beside the rank; our saves are synchronous "
            "(dist_checkpointing.save), so an in-process queue carries the same results; an "
            "asynchronous save would need the Manager queue back"
        ),
        apply=_keep_write_results_in_process,
    )
)
