"""The rollout engine a config asks for: megatron-core's inference with the options ``rollout.*`` sets.

Apart from :mod:`megatron_rl.rollout.engine` (the interface), which the engine's own modules import.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.config.schema import ModelConfig, RolloutLayoutConfig
from megatron_rl.rollout.engine import RolloutEngine


def on_active_layout(rollout):
    """``rollout`` (a RolloutConfig) with ``rollout.layout`` unset: an engine built from it generates
    on the layout of this process's world.  With generator ranks of their own, ``rollout.layout``
    is the generators' world's layout, so both worlds build their engines this way."""
    return dataclasses.replace(rollout, layout=RolloutLayoutConfig())


def make_rollout_engine(rollout, model_cfg: ModelConfig, device, record_routing: bool = False,
                        lora=None) -> RolloutEngine:
    """megatron's engine with the options ``rollout`` (a :class:`~megatron_rl.config.schema.RolloutConfig`)
    sets.  ``record_routing`` (MoE routing replay): the engine returns the experts it routed every
    token to.  ``lora`` (the actor's ``actor.lora``): a model of its own carries the same adapters.
    Imported here, so loading a config never imports megatron-core's inference."""
    from megatron_rl.rollout.megatron.engine import MegatronRolloutEngine

    return MegatronRolloutEngine(model_cfg, device=device, max_batch_size=rollout.max_batch_size,
                                 kv_cache_memory=rollout.kv_cache_memory,
                                 prefill_chunk_tokens=rollout.prefill_chunk_tokens,
                                 kv_block_tokens=rollout.kv_block_tokens, record_routing=record_routing,
                                 layout=rollout.layout, prefix_caching=rollout.prefix_caching,
                                 batching=rollout.batching, paged_attention=rollout.paged_attention,
                                 cuda_graphs=rollout.cuda_graphs, lora=lora)
