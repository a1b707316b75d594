"""The rollout interface the trainer talks to, and the engine registry.

Before each rollout the trainer hands the engine the actor's megatron chunks
(:meth:`RolloutEngine.load_from_chunks`); tests and the ``generate`` command may hand a canonical
state dict instead (:meth:`RolloutEngine.load_weights`).  The generator is megatron-core's
inference (:mod:`megatron_rl.rollout.megatron_engine`) on every layout: its dynamic engine or its
static-batching API (``rollout.batching``), on the actor's own shards or on a model of its own
(``rollout.layout``).  Engines are named in :data:`ENGINES`.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch

from megatron_rl.config.schema import ModelConfig, RolloutLayoutConfig
from megatron_rl.rollout.sampling import SamplingParams


@dataclass
class RolloutBatch:
    """One entry per sample, in parallel lists: sample ``j`` of prompt ``i`` is at ``i * n + j``.

    ``response_ids`` includes the stop token / stop sequence that ended a sample.
    ``response_logprobs[k][t]`` is the fp32 log-prob of ``response_ids[k][t]`` under the
    temperature-scaled full distribution (before top-k/top-p), the trainer's definition.
    ``finish_reason`` is ``"stop"`` or ``"length"``.  ``token_versions`` (partial rollouts): the
    policy version whose weights sampled each response token; None when the weights cannot change
    during a rollout.  ``routing`` (MoE routing replay, engines
    that record it): per sample, ``{layer_number: [tokens, topk] expert ids}`` for the MoE layers
    of this rank's pipeline stage, so it differs between stages; None when not recorded.
    Multi-turn trajectories (:mod:`megatron_rl.envs.trajectories`): ``response_mask`` is 1 on the
    policy's tokens and 0 on observations (whose log-probs are 0); ``env_info`` per sample: turns,
    limit hit, the environment's reward, the span of the last policy turn, tool counts.  Both None
    for single-turn rollouts.
    """

    prompt_index: list[int]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    finish_reason: list[str]
    routing: Optional[list[dict]] = None
    token_versions: Optional[list[list[int]]] = None
    response_mask: Optional[list[list[int]]] = None
    env_info: Optional[list[dict]] = None

    def __post_init__(self):
        sizes = {len(self.prompt_index), len(self.prompt_ids), len(self.response_ids),
                 len(self.response_logprobs), len(self.finish_reason)}
        for optional in (self.routing, self.token_versions, self.response_mask, self.env_info):
            if optional is not None:
                sizes.add(len(optional))
        if len(sizes) != 1:
            raise ValueError(f"RolloutBatch fields have different lengths: {sorted(sizes)}")

    def __len__(self) -> int:
        return len(self.prompt_index)


@runtime_checkable
class LiveWeights(Protocol):
    """Weights that may change while a rollout runs (partial rollouts): an engine that has one
    calls :meth:`poll` before drawing each token."""

    version: int  # the policy version of the weights the engine holds now

    def poll(self) -> bool:
        """Load newer weights into the engine if some arrived; True when it did (a collective of
        the ranks that generate together)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What every rollout engine implements."""

    def load_weights(self, canonical: dict[str, torch.Tensor]) -> None:
        """Replace the engine's weights with a canonical state dict (see models.canonical)."""

    def load_from_chunks(self, chunks: list) -> None:
        """Replace the engine's weights with the actor's, read from its megatron chunks."""

    def release_weights(self) -> None:
        """Free the weights' memory until the next load."""

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds for generation."""

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int,
                 sample_keys: Optional[list[int]] = None) -> RolloutBatch:
        """``len(prompt_ids) * params.n`` samples; the same seed reproduces them on one device.
        ``sample_keys`` (one :func:`~megatron_rl.rollout.sampling.sample_key` per sample): each draw
        is a pure function of its sample's key, response position and token instead, so a sample
        does not depend on which others share its call (multi-turn trajectories advancing on their
        own)."""


def stopped(response: list[int], params: SamplingParams) -> bool:
    """Whether ``response`` ends with a stop id or a stop sequence (one rule for every engine)."""
    if response[-1] in params.stop_token_ids:
        return True
    return any(
        len(response) >= len(seq) and tuple(response[-len(seq):]) == seq for seq in params.stop_sequences
    )


# name -> "module:class"; imported when built, so naming an engine (config validation) never
# imports megatron-core's inference.
ENGINES = {
    "megatron": "megatron_rl.rollout.megatron_engine:MegatronRolloutEngine",
}


def engine_class(name: str) -> type:
    """The class registered as ``name`` in :data:`ENGINES`."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known: {sorted(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(name: str, *args, **kwargs) -> RolloutEngine:
    """Build the engine registered as ``name`` (e.g. ``make_engine("megatron", model_cfg, device)``)."""
    return engine_class(name)(*args, **kwargs)


def on_active_layout(rollout):
    """``rollout`` (a RolloutConfig) with ``rollout.layout`` unset: an engine built from it generates
    on the layout of this process's world.  With generator ranks of their own, ``rollout.layout``
    is the generators' world's layout, so both worlds build their engines this way."""
    return dataclasses.replace(rollout, layout=RolloutLayoutConfig())


def make_rollout_engine(rollout, model_cfg: ModelConfig, device, record_routing: bool = False) -> RolloutEngine:
    """The engine ``rollout`` (a :class:`~megatron_rl.config.schema.RolloutConfig`) names -- ``auto``
    resolved for this model and ``device`` (:mod:`megatron_rl.rollout.choice`) -- with the
    options that engine takes.  ``record_routing`` (MoE routing replay): the engine returns the
    experts it routed every token to, where it can (megatron's engine; validation sends routing
    replay with another engine through the old-log-prob pass, which records them instead)."""
    from megatron_rl.rollout.choice import pick_engine

    return make_engine(pick_engine(rollout.engine), model_cfg, device=device, max_batch_size=rollout.max_batch_size,
                       kv_cache_memory=rollout.kv_cache_memory, prefill_chunk_tokens=rollout.prefill_chunk_tokens,
                       kv_block_tokens=rollout.kv_block_tokens, record_routing=record_routing,
                       layout=rollout.layout, prefix_caching=rollout.prefix_caching, batching=rollout.batching,
                       paged_attention=rollout.paged_attention, cuda_graphs=rollout.cuda_graphs)
