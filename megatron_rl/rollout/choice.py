"""How megatron's engine generates: ``rollout.batching`` with ``auto`` resolved.

megatron-core's inference, the only engine, generates on every layout (``rollout.engine``, ``auto``
or ``megatron``, names it).  It batches one of two ways (``rollout.batching``):

* ``dynamic`` -- its ``DynamicInferenceEngine``: a paged KV cache, continuous batching, chunked
  prefill, prefix caching by pages, CUDA graphs for decode steps.  Picked by ``auto`` on CUDA (its
  paged attention: flash-attn's kernels or the Triton kernel, ``rollout.paged_attention``), and
  wherever only it can generate: MoE layers (expert-parallel ranks step together) and partial
  rollouts (requests re-prefilled on a weight push).
* ``static`` -- its static-batching API (``StaticInferenceContext``): distinct prompts left-padded
  and prefilled once, one KV cache per layer (:mod:`megatron_rl.rollout.static_batching`).
  Picked by ``auto`` on the CPU, where the dynamic engine's per-step scheduling costs more than
  the model (``docs/rollout.md``); upstream marks it for removal, so it stays only where it is
  measured faster.

One rule, read by config resolution (before any process starts) and by the engine when it
generates, so both see the same choice.
"""

from __future__ import annotations

from megatron_rl.capabilities import paged_kernels_installed
from megatron_rl.config.choices import ASYNC, AUTO, ROLLOUT_BATCHING
from megatron_rl.layout.arch import is_moe

_, DYNAMIC, STATIC = ROLLOUT_BATCHING


def pick_batching(requested: str, *, moe: bool, partial: bool, paged_kernels: bool) -> str:
    """``rollout.batching`` with ``auto`` resolved (the module doc)."""
    if requested != AUTO:
        return requested
    if moe or partial or paged_kernels:
        return DYNAMIC
    return STATIC


def batching_reason(batching: str, *, moe: bool, partial: bool, paged_kernels: bool) -> str:
    """Why ``auto`` picked ``batching``, for the resolved-config report and the trainer's log."""
    if moe:
        return "MoE layers: expert-parallel ranks step together"
    if partial:
        return "partial rollouts re-prefill requests on a weight push"
    if paged_kernels:
        return "CUDA with paged attention kernels (flash-attn's or Triton's)"
    return "the CPU: the dynamic engine's per-step scheduling costs more there (docs/rollout.md)"


def batching_refusal(batching: str, *, moe: bool, partial: bool, **_facts) -> str:
    """Why ``batching`` cannot generate this rollout ('' when it can)."""
    if batching != STATIC:
        return ""
    if moe:
        return "MoE layers need the dynamic engine (expert-parallel ranks step together); set rollout.batching=auto"
    if partial:
        return ("trainer.partial_rollouts needs the dynamic engine (requests re-prefilled on a weight push); "
                "set rollout.batching=auto")
    return ""


def cuda_graphs_refusal(*, cuda: bool, batching: str, kernels: str, moe: bool) -> str:
    """Why decode steps cannot replay CUDA graphs here ('' when they can)."""
    from megatron_rl.compat.paged_attention import KERNELS

    if not cuda:
        return "CUDA graphs need CUDA"
    if batching != DYNAMIC:
        return f"CUDA graphs are the dynamic engine's (rollout.batching={batching})"
    if not KERNELS[kernels].graph_safe:
        return f"rollout.paged_attention={kernels} reads lengths on the host, which a graph cannot hold"
    if moe:
        return "megatron graphs MoE layers only in its inference-optimized layers"
    return ""


def pick_cuda_graphs(requested, *, cuda: bool, batching: str, kernels: str, moe: bool) -> tuple[bool, str]:
    """``rollout.cuda_graphs`` with null resolved -- on wherever they can run -- and why."""
    if requested is not None:
        return bool(requested), ""
    refusal = cuda_graphs_refusal(cuda=cuda, batching=batching, kernels=kernels, moe=moe)
    return (False, refusal) if refusal else (True, "CUDA, dynamic batching, graph-safe paged kernels")


def batching_facts(cfg, cuda: bool) -> dict:
    """What :func:`pick_batching` reads for a full config (a :class:`~megatron_rl.config.schema.Config`)
    on a machine with or without CUDA; paged attention kernels looked up where there is CUDA."""
    return dict(moe=is_moe(cfg.model), partial=cfg.trainer.mode == ASYNC and cfg.trainer.partial_rollouts,
                paged_kernels=cuda and paged_kernels_installed())


def rollout_batching(cfg) -> str:
    """How megatron's engine batches for ``cfg`` on this machine."""
    from megatron_rl.distributed.runtime import resolve_device  # the device the run will use

    cuda = resolve_device(cfg.distributed).type == "cuda"
    return pick_batching(cfg.rollout.batching, **batching_facts(cfg, cuda))


def describe_rollout_engine(cfg) -> str:
    """``"megatron engine, static batching (auto: the CPU: ...)"``, or without the reason when
    ``rollout.batching`` is set."""
    from megatron_rl.distributed.runtime import resolve_device

    facts = batching_facts(cfg, resolve_device(cfg.distributed).type == "cuda")
    batching = pick_batching(cfg.rollout.batching, **facts)
    if cfg.rollout.batching != AUTO:
        return f"megatron engine, {batching} batching"
    return f"megatron engine, {batching} batching (auto: {batching_reason(batching, **facts)})"
