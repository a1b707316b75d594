"""A model that trains: megatron DDP around each chunk, megatron's optimizer and LR schedule.

Gradient normalisation: each micro-batch's loss is already divided by the denominator of the whole
mini-batch (:mod:`megatron_rl.trainer.update`) and returned with a count of 0
(:mod:`megatron_rl.engine.forward`).  With ``calculate_per_token_loss`` megatron sums the
gradients over micro-batches and data/context-parallel ranks instead of averaging them, and
``finalize_model_grads`` skips its division by the count when that is 0.  The result does not
depend on how the batch was cut.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rl.config.schema import OptimConfig
from megatron_rl.distributed import collectives
from megatron_rl.engine.lr_schedules import LR_SCHEDULES


@dataclasses.dataclass(frozen=True)
class StepResult:
    ok: bool
    grad_norm: float
    reason: str = ""


@dataclasses.dataclass
class Trainable:
    chunks: list  # DDP-wrapped model chunks (one per virtual stage)
    optimizer: object
    scheduler: OptimizerParamScheduler

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def weights_replaced(self) -> None:
        """Call after weights were copied into ``chunks`` from elsewhere (HF, a checkpoint without
        optimizer state, another model, a seeded draw).  megatron-core's mixed-precision
        optimizers keep fp32 master copies of bf16/fp16 weights from when they were built; left
        stale, the next step would write them back over the loaded weights."""
        self.optimizer.reload_model_params()

    def step(self) -> StepResult:
        """One optimizer step; skipped (and reported) when the gradients or the learning rate are
        not finite.  With both finite, Adam's update is finite: no non-finite update is applied.

        megatron's ``optimizer.step()`` in pieces, each once: ``prepare_grads``, one gradient norm
        (one pass over every gradient, one all-reduce, one read back to the host), the clip by that
        norm, ``step_with_ready_grads``.  Calling ``step()`` after checking the norm would prepare the
        gradients and compute their norm a second time."""
        found_inf = self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(norm):
            return StepResult(False, norm, "non-finite gradients: update skipped")
        bad_lr = next((g["lr"] for g in self.optimizer.param_groups if not math.isfinite(g["lr"])), None)
        if bad_lr is not None:
            return StepResult(False, norm, f"learning rate {bad_lr} is not finite: update skipped")
        clip_by_norm(self.optimizer, norm)
        if not self.optimizer.step_with_ready_grads():
            return StepResult(False, norm, "optimizer reported overflow: update skipped")
        self.scheduler.step(increment=1)
        return StepResult(True, norm)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


def clip_by_norm(optimizer, norm: float) -> None:
    """Scale the gradients of ``optimizer`` (megatron's, chained or not) to ``clip_grad`` when their
    total ``norm`` exceeds it, as megatron's own ``step()`` does with the norm it computes."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if opt.config.clip_grad > 0.0 and params and not getattr(opt, "is_stub_optimizer", False):
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def ddp_config(device_type: str, optim: OptimConfig | None = None) -> DistributedDataParallelConfig:
    """Megatron DDP settings for chunks on ``device_type`` (a pure function, so it is testable anywhere).

    On CUDA gradients are reduced bucket by bucket while backward still runs, so the DP x CP
    reduction hides behind compute.  On the CPU (gloo) there is nothing to overlap with: one bucket
    after backward, the setting every CPU parity test proves.  Gradients are accumulated and
    reduced in fp32 unless ``optim.grad_reduce_dtype`` asks for bf16, on any device.
    """
    optim = optim or OptimConfig()
    overlap = device_type == "cuda" and optim.overlap_grad_reduce
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=optim.grad_reduce_dtype == "float32",
        overlap_grad_reduce=overlap,
        overlap_param_gather=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=optim.grad_reduce_bucket_size if overlap else None,
    )


def wrap_ddp(chunks: list, use_distributed_optimizer: bool = False,
             settings: DistributedDataParallelConfig | None = None) -> list:
    """``chunks`` in megatron DDP with ``settings`` (default: :func:`ddp_config` for their device)."""
    config = chunks[0].config
    if settings is None:
        settings = ddp_config(next(chunks[0].parameters()).device.type,
                              OptimConfig(use_distributed_optimizer=use_distributed_optimizer))
    wrapped = [
        DistributedDataParallel(config=config, ddp_config=dataclasses.replace(settings), module=chunk,
                                disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    if settings.overlap_grad_reduce:
        # Each chunk starts its reduction when the schedule finishes its last backward.
        config.grad_sync_func = [w.start_grad_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].start_grad_sync
    return wrapped


def make_trainable(chunks: list, optim: OptimConfig, total_steps: int) -> Trainable:
    """Wrap ``chunks`` in DDP and build the optimizer and LR schedule."""
    settings = ddp_config(next(chunks[0].parameters()).device.type, optim)
    return rebuild_optimizer(wrap_ddp(chunks, optim.use_distributed_optimizer, settings), optim, total_steps)


def rebuild_optimizer(wrapped: list, optim: OptimConfig, total_steps: int) -> Trainable:
    """A :class:`Trainable` with a new optimizer and schedule around already DDP-wrapped chunks
    (wrapping twice would register megatron's gradient hooks twice and double every gradient).
    The old optimizer is dropped: whoever held it must take the returned Trainable."""
    config = wrapped[0].module.config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, wrapped, use_gloo_process_groups=False)
    decay_steps = max(total_steps, optim.warmup_steps + 1)
    decay_style, decays = LR_SCHEDULES[optim.schedule]
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr if decays else optim.lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
    return Trainable(wrapped, optimizer, scheduler)


def freeze(chunks: list) -> list:
    """For the reference model: no grads, no optimizer state, eval mode."""
    for chunk in chunks:
        chunk.eval()
        for param in chunk.parameters():
            param.requires_grad_(False)
    return chunks


def weights_finite(chunks: list) -> bool:
    """Whether every parameter of ``chunks`` is finite on every rank: one fused max-abs per rank (a
    max cannot overflow, and NaN propagates through it) and one all-reduce, so every rank gets the
    same answer."""
    params = [p.detach() for chunk in chunks for p in chunk.parameters() if p.is_floating_point()]  # int8: finite
    finite = True
    if params:
        finite = bool(torch.isfinite(torch.stack(torch._foreach_norm(params, math.inf)).max()))
    return not collectives.agree_any(not finite)
