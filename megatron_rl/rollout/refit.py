"""``rollout.layout``: the inference model's own layout, refreshed from the training shards.

Training and generating want different layouts: a 7B policy at 32k trains at TP4 x CP2 with
recompute and generates best at TP1 or TP2 with many replicas, no CP and no recompute.  The
inference model here is a second :class:`~megatron_rl.models.gpt.RLGPTModel` on the same ranks,
built once with process groups of its own (megatron-core's
``megatron.core.inference.shards.build_inference_pg_collection``: TP / PP / EP / expert-TP of
``rollout.layout``, CP 1, the rest data-parallel replicas).  Before every rollout
:func:`refit` moves the actor's weights into it with megatron-core's
``megatron.core.resharding.swap_model_weights``: a plan built once (collectively) and cached,
each rank receiving exactly the slices of its inference shard (gloo on the CPU, NCCL on GPU).

When the inference layout equals the training layout (same TP / PP / EP / expert-TP, one chunk
per rank) there is nothing to move: the engine generates with the actor's chunk in place
(:func:`megatron_rl.planner.memory.shares_training_weights`), as it always did.

With LoRA the inference model carries the actor's adapters (:func:`build_inference_model` with
``lora``), and since the base is frozen only the first refit moves it: later ones move the adapter
tensors alone (``adapters_only``), on a plan of their own kept apart from megatron's cached full
plan (which megatron keys by layout sizes, the same for both views).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch
import torch.distributed as dist

from megatron_rl.compat.resharding import cached_reshard_plan, global_layer_renamer, preset_refit_tensors
from megatron_rl.config.schema import ModelConfig
from megatron_rl.distributed.runtime import layout_groups
from megatron_rl.layout.lora import is_adapter_param, lora_on
from megatron_rl.layout.sizes import ParallelLayout


@functools.lru_cache(maxsize=None)
def inference_groups(infer: ParallelLayout, world: int):
    """megatron's process groups of the inference layout over the whole world (collective)."""
    return layout_groups(infer.tp, infer.pp, infer.ep, infer.expert_tp, world)


def build_inference_model(model_cfg: ModelConfig, infer: ParallelLayout, train: ParallelLayout,
                          device: torch.device, lora=None):
    """This rank's shard of the inference model, weights allocated but not initialised (the
    first :func:`refit` fills them); ``lora`` (the actor's LoRAConfig): the same adapters, so it
    generates with them and not from the base."""
    from megatron_rl.capabilities import resolve_transformer_impl
    from megatron_rl.layout.arch import resolve_dtype
    from megatron_rl.models.builder import gpt_model, transformer_config
    from megatron_rl.models.moe import attach_moe_state

    world = dist.get_world_size()
    groups = inference_groups(infer, world)
    layout = dataclasses.replace(infer.on_world(world), etp=infer.etp if infer.etp != infer.tp else None)
    impl = resolve_transformer_impl(model_cfg.transformer_impl)
    dtype = resolve_dtype(model_cfg.params_dtype, device)
    # Recompute is a training setting: the inference model never runs a backward.
    config = transformer_config(model_cfg, layout, dtype, impl, device=device, initialize=False,
                                recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                                recompute_modules=None)
    vocab = refit_vocab_rows(model_cfg, train.tp, infer.tp)
    pp_rank, pp_size = groups.pp.rank(), groups.pp.size()
    model = gpt_model(model_cfg, config, impl, vocab, pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1,
                      pp_rank=pp_rank, pg_collection=groups)
    model = model.to(device).eval().requires_grad_(False)
    attach_moe_state([model])
    if lora_on(lora):
        from megatron_rl.models.lora.adapters import attach_inference_lora

        attach_inference_lora([model], model_cfg, lora)
    return model


def refit_vocab_rows(model_cfg: ModelConfig, train_tp: int, infer_tp: int) -> int:
    """The inference model's vocabulary rows: the training model's padded count, so the
    embedding and output layer map row for row (a TP1 model alone would pad less than a TP2 one)."""
    from megatron_rl.layout.arch import padded_vocab_size

    rows = padded_vocab_size(model_cfg.vocab_size, model_cfg.make_vocab_size_divisible_by, train_tp)
    if rows % infer_tp:
        raise ValueError(f"rollout.layout.tp={infer_tp} does not divide the {rows} vocabulary rows of the training "
                         f"model (parallel.tp={train_tp}); use a TP that divides {rows}")
    return rows


@dataclasses.dataclass(frozen=True)
class RefitStats:
    seconds: float
    bytes_received: int  # bytes this rank received into its inference shard (copies within the rank included)
    shard_bytes: int = 0  # bytes of the shard it fills (every parameter and persistent buffer)


def refit(train_chunks: list, infer_model, method: str, adapters_only: bool = False) -> RefitStats:
    """Copy the actor's weights (``train_chunks``: this rank's megatron chunks, DDP-wrapped or
    not) into ``infer_model`` with megatron-core's resharding; collective over the world.
    ``adapters_only``: the LoRA adapters alone (the frozen base is already there from a full refit)."""
    from megatron.core.resharding import get_or_create_service
    from megatron.core.resharding.refit import swap_model_weights

    from megatron_rl.models.canonical import unwrap

    chunks = [unwrap(c) for c in train_chunks]
    source, target = _refit_view(chunks), _refit_view([infer_model])
    _forget_plans_of_other_models(source, target)
    start = time.perf_counter()
    with torch.no_grad():
        if not adapters_only:
            swap_model_weights([source], [target], refit_method=method)
            return RefitStats(time.perf_counter() - start, received_bytes(source, target))
        source, target = _refit_view(chunks, ADAPTERS), _refit_view([infer_model], ADAPTERS)
        plan = _adapter_plan(("local", source, target), source, target)
        _execute(plan, source, target, get_or_create_service(method))
    return RefitStats(time.perf_counter() - start, _plan_received_bytes(plan, target))


def snapshot_for_push(train_chunks: list, group, trainers: int, adapters_only: bool = False):
    """This trainer rank's weights as a push after this update will send them: a copy of the
    tensors the cross-world plan has this rank send (all of its tensors before the plan exists),
    taken now so the trainers go on updating while the copy waits for the generators.
    ``adapters_only``: the LoRA adapters alone (the generators hold the frozen base already)."""
    from megatron.core.resharding.utils import named_refit_tensors

    from megatron_rl.models.canonical import unwrap

    chunks = [unwrap(c) for c in train_chunks]
    if adapters_only:
        plan = _ADAPTER_PLANS.get(_cross_world_key(group, trainers))
    else:
        plan = _cross_world_plan(_refit_view(chunks), None, group, trainers)
    sent = None if plan is None else {op.param_name for op in plan.send_ops}
    view = _RefitView(chunks, ADAPTERS if adapters_only else None)
    with torch.no_grad():
        tensors = {n: t.detach().clone() for n, t in named_refit_tensors(_refit_view(chunks, view.only))
                   if sent is None or n in sent}
    preset_refit_tensors(view, tensors)
    return view


def refit_across_worlds(source, infer_model, group, trainers: int, data=None, adapters_only: bool = False
                        ) -> RefitStats:
    """One push from the training world to the generating world with megatron-core's resharding:
    trainer ranks pass ``source`` (a :func:`snapshot_for_push`) and ``infer_model=None``,
    generator ranks ``None`` and their shard of the inference model; collective over ``group``
    (:func:`megatron_rl.distributed.cross_world.joint_group`), whose first ``trainers`` ranks
    train.  The plan is built at the first push and cached; the bytes travel on ``data``
    (:func:`~megatron_rl.distributed.cross_world.data_group`: NCCL on GPUs; ``group`` when None).
    ``adapters_only`` (LoRA, after the first push): the adapters alone, on a plan of their own;
    every rank of both worlds passes the same (trainer ranks: their snapshot's)."""
    from megatron.core.resharding.refit import swap_model_weights

    from megatron_rl.distributed.cross_world import copy_service

    adapters_only = source.only is not None if source is not None else adapters_only
    target = _refit_view([infer_model], ADAPTERS if adapters_only else None) if infer_model is not None else None
    start = time.perf_counter()
    with torch.no_grad():
        if adapters_only:
            plan = _adapter_plan(_cross_world_key(group, trainers), source, target, group=group,
                                 src_rank_offset=0, dst_rank_offset=trainers)
            _execute(plan, source, target, copy_service(group, data), group=group)
        else:
            swap_model_weights([source] if source is not None else None, [target] if target is not None else None,
                               refit_method=copy_service(group, data), group=group, src_rank_offset=0,
                               dst_rank_offset=trainers)
    seconds = time.perf_counter() - start
    if target is None:
        return RefitStats(seconds, 0)
    from megatron.core.resharding.utils import get_refit_tensor_dict

    shard = sum(t.numel() * t.element_size() for t in get_refit_tensor_dict(_refit_view([infer_model])).values())
    if not adapters_only:
        plan = _cross_world_plan(None, target, group, trainers)
    return RefitStats(seconds, _plan_received_bytes(plan, target), shard)


ADAPTERS = "adapters"  # the view of a model's LoRA adapter tensors alone
_ADAPTER_PLANS: dict = {}  # key -> the adapters-only plan (megatron's own cache keeps the full one)


def _adapter_plan(key, source, target, **kw):
    """The adapters-only reshard plan for ``key``, built (collectively) at its first use."""
    from megatron.core.resharding import build_local_reshard_plan

    if key not in _ADAPTER_PLANS:
        experts = (source if source is not None else target).config.num_moe_experts
        _ADAPTER_PLANS[key] = build_local_reshard_plan(source, target, num_experts=experts, **kw)
    return _ADAPTER_PLANS[key]


def _execute(plan, source, target, service, group=None) -> None:
    from megatron.core.resharding import execute_reshard_plan

    execute_reshard_plan(plan, source, target, service=service, group=group)


def _cross_world_key(group, trainers: int) -> tuple:
    return ("cross", group.rank(), group.size(), trainers)


def _cross_world_plan(source, target, group, trainers: int):
    plan, _ = cached_reshard_plan([source] if source is not None else None, [target] if target is not None else None,
                                  group=group, src_rank_offset=0, dst_rank_offset=trainers)
    return plan


_PLANNED: list = []  # the (source, inference model) pair megatron's cached plans were built for


def _forget_plans_of_other_models(source, infer_model) -> None:
    """megatron caches reshard plans by the two layouts' sizes, not by model: a plan built for
    other models of the same sizes (another run in this process) names their tensors' slices, so
    it is dropped when the pair changes."""
    from megatron.core.resharding.refit import clear_plan_cache

    pair = (source, infer_model)
    if not _PLANNED or _PLANNED[0][0] is not source or _PLANNED[0][1] is not infer_model:
        clear_plan_cache()
        _ADAPTER_PLANS.clear()
        _PLANNED[:] = [pair]


def _refit_view(chunks: list, only=None) -> "_RefitView":
    """The one module per rank megatron's resharding reads (made once per set of chunks and
    ``only``, so the plan cached for it stays valid)."""
    attr = "_refit_view" if only is None else f"_refit_view_{only}"
    view = getattr(chunks[0], attr, None)
    if view is None or view.chunks != chunks:
        view = _RefitView(chunks, only)
        object.__setattr__(chunks[0], attr, view)  # not a submodule: no cycle in named_modules
    return view


def received_bytes(source, infer_model) -> int:
    """Bytes the cached plan writes into this rank's inference shard per refit."""
    plan, tgt_core = cached_reshard_plan([source], [infer_model])
    return _plan_received_bytes(plan, tgt_core) if plan is not None else 0


def _plan_received_bytes(plan, tgt_core) -> int:
    from megatron.core.resharding.utils import get_refit_tensor_dict

    tensors = get_refit_tensor_dict(tgt_core)
    total = 0
    for op in plan.recv_ops:
        t = tensors[op.param_name]
        total += t[op.my_slice].numel() * t.element_size()
    return total


class _RefitView(torch.nn.Module):
    """A rank's chunks of one model as megatron's resharding should see them: one module whose
    parameters are named by global layer index (VPP chunks each number their layers from 0) and
    global expert index.  megatron-core 0.19 resolves expert numbers only in TransformerEngine's
    grouped names (``weightK``); the local spec's ``SequentialMLP`` names its experts
    ``local_experts.K`` on every EP rank, so without this an EP2 -> EP1 refit finds no source.

    ``only=ADAPTERS``: the LoRA adapter parameters alone (no base weight, no buffer)."""

    def __init__(self, chunks: list, only=None):
        super().__init__()
        self.chunks = chunks  # a plain list: the chunks are not submodules, only named below
        self.only = only
        self.config = chunks[0].config
        self.pg_collection = chunks[0].pg_collection
        ep = getattr(self.pg_collection, "ep", None)
        experts = self.config.num_moe_experts or 0
        self._first_expert = ep.rank() * (experts // ep.size()) if ep is not None and experts else 0

    def _renamers(self):
        for chunk in self.chunks:
            global_layer = global_layer_renamer(chunk)
            yield chunk, lambda name, rename=global_layer: self._global_expert(rename(name))

    def _global_expert(self, name: str) -> str:
        parts = name.split(".")
        for i in range(len(parts) - 1):
            if parts[i] == "local_experts" and parts[i + 1].isdigit():
                parts[i + 1] = str(self._first_expert + int(parts[i + 1]))
        return ".".join(parts)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for chunk, rename in self._renamers():
            for name, param in chunk.named_parameters(recurse=recurse):
                if self.only is None or is_adapter_param(name):
                    yield rename(name), param

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        yield "", self
        for chunk, rename in self._renamers():
            for name, module in chunk.named_modules():
                if name and (self.only is None or is_adapter_param(name + ".")):
                    yield rename(name), module
