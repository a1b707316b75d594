"""The rollout interface the trainer talks to.

Before each rollout the trainer hands the engine the actor's megatron chunks
(:meth:`RolloutEngine.load_from_chunks`); tests and the ``generate`` command may hand a canonical
state dict instead (:meth:`RolloutEngine.load_weights`).  The generator is megatron-core's
inference (:mod:`megatron_rl.rollout.megatron`) on every layout: its dynamic engine or its
static-batching API (``rollout.batching``), on the actor's own shards or on a model of its own
(``rollout.layout``), built from ``rollout.*`` by :func:`megatron_rl.rollout.build.make_rollout_engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

import torch

from megatron_rl.rollout.sampling import SamplingParams

if TYPE_CHECKING:
    from megatron_rl.rollout.refit import RefitStats

# (generators, this rank's generator, whether this rank reports that generator's samples)
GeneratorPlace = tuple[int, int, bool]


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
    """What every rollout engine implements (:class:`RolloutEngineBase` gives the optional parts'
    defaults to an engine that has no use for them)."""

    # Partial rollouts: weights that may change while a rollout runs; the trainer or the generator
    # ranks set it, and samples then carry the version of each token.  None: they cannot change.
    live_weights: Optional[LiveWeights]

    @property
    def last_refit(self) -> Optional[RefitStats]:
        """The latest copy of the weights into a model of the engine's own (``rollout.layout``), whose
        seconds and bytes the trainer logs; None while it generates on the actor's own shards."""

    @property
    def max_sequence_length(self) -> Optional[int]:
        """Most positions a prompt plus its response may take (None: no limit).  Multi-turn
        rollouts split a turn's call by it, since megatron's engine refuses a request past it."""

    def generator_of_this_rank(self) -> Optional[GeneratorPlace]:
        """``(generators, this rank's generator, whether it reports)`` where the engine generates on a
        layout of its own; None where the training layout's DP x CP ranks are the generators, which
        :func:`megatron_rl.rollout.dp.generator_of_this_rank` then reads."""

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


class RolloutEngineBase:
    """The optional parts of :class:`RolloutEngine` for an engine without them: weights that never
    change during a rollout, no model of its own to refit, no position limit, and the training
    layout's ranks as the generators."""

    live_weights: Optional[LiveWeights] = None
    last_refit: Optional[RefitStats] = None
    max_sequence_length: Optional[int] = None

    def generator_of_this_rank(self) -> Optional[GeneratorPlace]:
        return None


def stopped(response: list[int], params: SamplingParams) -> bool:
    """Whether ``response`` ends with a stop id or a stop sequence (one rule for every engine)."""
    if response[-1] in params.stop_token_ids:
        return True
    return any(
        len(response) >= len(seq) and tuple(response[-len(seq):]) == seq for seq in params.stop_sequences
    )
