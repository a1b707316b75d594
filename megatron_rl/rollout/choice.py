"""Which rollout engine ``rollout.engine=auto`` (the default) runs.

megatron-core's dynamic inference engine (``megatron``) wherever it can run well: on CUDA with
flash-attn's paged kernels, on any layout (with virtual pipeline stages on a model of its own,
refit from the interleaved chunks: ``rollout.layout``); it is also the only engine with MoE layers.
Elsewhere the project's KV-cache decoder (``torch``): on the CPU it is faster than megatron's
engine over the SDPA stand-in for those kernels (``docs/rollout.md``,
``benchmarks/rollout_throughput.py``).

One rule, read by config validation (before any process starts) and by the trainer and
``megatron-rl generate`` when they build the engine, so both see the same engine.
"""

from __future__ import annotations

from megatron_rl.capabilities import PAGED_FLASH_ATTN_MIN, paged_flash_attention_installed
from megatron_rl.config.choices import ROLLOUT_ENGINES
from megatron_rl.models.arch import is_moe

# What ``rollout.engine`` accepts (config/choices.py); the engines are registered in rollout/engine.py:ENGINES.
AUTO, TORCH, TP_SHARDED, MEGATRON = ENGINE_CHOICES = ROLLOUT_ENGINES


def pick_engine(requested: str, *, moe: bool, cuda: bool, paged_flash: bool) -> str:
    """``requested`` with ``auto`` resolved (any other name is returned as it is)."""
    if requested != AUTO:
        return requested
    if moe:
        return MEGATRON
    return MEGATRON if cuda and paged_flash else TORCH


def auto_reason(engine: str, *, moe: bool, cuda: bool, paged_flash: bool) -> str:
    """Why ``auto`` picked ``engine``, for the trainer's log."""
    if moe:
        return "the only engine with MoE layers"
    if engine == MEGATRON:
        return "CUDA with flash-attn's paged kernels"
    if cuda:
        return f"flash-attn >= {PAGED_FLASH_ATTN_MIN} is not installed for megatron's paged attention"
    return "on the CPU the KV-cache decoder is faster than megatron's engine"


def engine_facts(model_cfg, cuda: bool) -> dict:
    """What :func:`pick_engine` reads for this model and device, flash-attn's paged kernels
    looked up where there is CUDA."""
    return dict(moe=is_moe(model_cfg), cuda=cuda, paged_flash=cuda and paged_flash_attention_installed())


def _config_facts(cfg) -> dict:
    from megatron_rl.distributed.runtime import resolve_device  # the device the run will use

    return engine_facts(cfg.model, resolve_device(cfg.distributed).type == "cuda")


def rollout_engine(cfg) -> str:
    """The engine ``cfg`` (a full :class:`~megatron_rl.config.schema.Config`) generates with on
    this machine."""
    return pick_engine(cfg.rollout.engine, **_config_facts(cfg))


def describe_rollout_engine(cfg) -> str:
    """``"megatron engine (auto: CUDA with flash-attn's paged kernels)"``, or ``"tp_sharded engine"``
    when it is set explicitly."""
    facts = _config_facts(cfg)
    engine = pick_engine(cfg.rollout.engine, **facts)
    if cfg.rollout.engine != AUTO:
        return f"{engine} engine"
    return f"{engine} engine (auto: {auto_reason(engine, **facts)})"
