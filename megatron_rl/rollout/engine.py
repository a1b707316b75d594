"""Rollout engines: the interface the trainer talks to, the registry, and the plain-PyTorch engine.

Before each rollout the trainer hands an engine the actor's megatron chunks
(:meth:`RolloutEngine.load_from_chunks`) and each engine takes the weights it needs from them:
this one gathers a full canonical copy onto every rank, the TP-sharded engine
(:mod:`megatron_rl.rollout.tp_engine`) keeps its rank's shard.  Tests and benchmarks may hand a
canonical state dict instead (:meth:`RolloutEngine.load_weights`).  Engines are picked by name
from :data:`ENGINES`.

:class:`TorchRolloutEngine` runs :class:`~megatron_rl.rollout.decoder.TorchDecoder` on the rank's
device: left-padded prompts are prefilled in one batched forward, then every unfinished row
advances one token per step through a preallocated KV cache.  A finished row stops growing; once
at most half of the rows are still running, the finished ones are dropped from the batch so late
steps do not pay for them.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

import torch

from megatron_rl.config.schema import ModelConfig, RolloutLayoutConfig
from megatron_rl.models.arch import resolve_dtype
from megatron_rl.rollout.decoder import WHOLE_MODEL, KVCache, TensorParallel, TorchDecoder, left_pad
from megatron_rl.rollout.sampling import SamplingParams, keyed_exponentials, sample


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


class TorchRolloutEngine:
    """KV-cached generation with :class:`TorchDecoder`; ``max_batch_size`` rows per pass."""

    def __init__(self, model_cfg: ModelConfig, device="cpu", max_batch_size: int = 64, dtype=None,
                 tp: TensorParallel = WHOLE_MODEL):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        dtype = dtype or resolve_dtype(model_cfg.params_dtype, self.device)
        # Built without initialising weights: load_weights() provides every tensor.
        with torch.device("meta"):
            model = TorchDecoder(model_cfg, dtype=dtype, tp=tp)
        self.model = model.to_empty(device=self.device).eval().requires_grad_(False)
        self._loaded = False
        # Partial rollouts: weights that can change between two tokens; None = fixed per rollout.
        self.live_weights: Optional[LiveWeights] = None

    def load_weights(self, canonical: dict[str, torch.Tensor]) -> None:
        self._materialize()
        self.model.load_canonical(canonical)
        self._loaded = True

    def load_from_chunks(self, chunks: list) -> None:
        """Load the actor's current weights from its megatron chunks (any layout): gathered into
        one full canonical copy on every rank."""
        from megatron_rl.models.canonical import gather_canonical  # megatron's groups

        self.load_weights(gather_canonical(chunks))

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds for generation (while loaded)."""
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def release_weights(self) -> None:
        """Free the weights' device memory until the next load.

        The trainer reloads the actor's weights before every rollout, so between rollouts they are
        dead weight: released, training has the memory the planner counts for it."""
        for tensor in self.model.state_dict().values():
            tensor.untyped_storage().resize_(0)
        self._loaded = False

    def _materialize(self) -> None:
        """Give released weights their storage back (contents are overwritten by the load)."""
        for tensor in self.model.state_dict().values():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(tensor.numel() * tensor.element_size())

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int,
                 sample_keys: Optional[list[int]] = None) -> RolloutBatch:
        if not self._loaded:
            raise RuntimeError("TorchRolloutEngine.generate called before load_weights")
        vocab = self.model.cfg.vocab_size
        for i, prompt in enumerate(prompt_ids):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        samples = [(i, list(p)) for i, p in enumerate(prompt_ids) for _ in range(params.n)]
        if sample_keys is not None and len(sample_keys) != len(samples):
            raise ValueError(f"{len(sample_keys)} sample keys for {len(samples)} samples")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        responses, logprobs, reasons, versions = [], [], [], []
        for start in range(0, len(samples), self.max_batch_size):
            prompts = [p for _, p in samples[start : start + self.max_batch_size]]
            keys = sample_keys[start : start + self.max_batch_size] if sample_keys is not None else None
            r, lp, why, v = self._generate_batch(prompts, params, generator, keys)
            responses += r
            logprobs += lp
            reasons += why
            versions += v
        return RolloutBatch(
            prompt_index=[i for i, _ in samples],
            prompt_ids=[p for _, p in samples],
            response_ids=responses,
            response_logprobs=logprobs,
            finish_reason=reasons,
            token_versions=versions if self.live_weights is not None else None,
        )

    def _prefill(self, sequences: list[list[int]], new_tokens: int):
        """Logits of the next token of every sequence, the KV cache holding them with room for
        ``new_tokens`` more, and the position of each next token."""
        ids, mask, positions = (t.to(self.device) for t in left_pad(sequences))
        cache = KVCache.for_model(self.model, ids.shape[0], ids.shape[1] + new_tokens)
        logits = self.model(ids, positions, cache, mask, last_only=True)[:, -1]
        return logits, cache, mask.sum(1)

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, generator, keys=None):
        dev = self.device
        b = len(prompts)
        logits, cache, next_pos = self._prefill(prompts, params.max_new_tokens)

        responses: list[list[int]] = [[] for _ in range(b)]
        logprobs: list[list[float]] = [[] for _ in range(b)]
        versions: list[list[int]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        rows = list(range(b))  # batch row -> sample; shrinks when finished rows are dropped
        live = self.live_weights
        for step in range(params.max_new_tokens):
            if live is not None and live.poll():
                # Newer weights arrived: the running samples go on with them.  Their KV cache is
                # recomputed with the new weights, so every later token is drawn from the new
                # policy given the sample so far, and its log-prob is that policy's.
                rows = [s for s in rows if reasons[s] != "stop"]
                logits, cache, next_pos = self._prefill([prompts[s] + responses[s] for s in rows],
                                                        params.max_new_tokens - step)
            noise = None
            if keys is not None:
                noise = keyed_exponentials(torch.tensor([keys[s] for s in rows], device=dev),
                                           torch.tensor([len(responses[s]) for s in rows], device=dev),
                                           logits.shape[-1])
            tokens, token_logp = self.model.tp.first_rank_draw(*sample(logits, params, generator, noise))
            running = []
            for r, (s, tok, lp) in enumerate(zip(rows, tokens.tolist(), token_logp.tolist())):
                if reasons[s] == "stop":
                    continue
                responses[s].append(tok)
                logprobs[s].append(lp)
                if live is not None:
                    versions[s].append(live.version)
                if stopped(responses[s], params):
                    reasons[s] = "stop"
                else:
                    running.append(r)
            if not running or step + 1 == params.max_new_tokens:
                break
            if 2 * len(running) <= len(rows):
                keep = torch.tensor(running, device=dev)
                cache.keep(keep)
                tokens, next_pos = tokens[keep], next_pos[keep]
                rows = [rows[r] for r in running]
                step_mask = None
            else:
                step_mask = torch.zeros(len(rows), 1, dtype=torch.bool)
                step_mask[running] = True
                step_mask = step_mask.to(dev)
            logits = self.model(tokens[:, None], next_pos[:, None], cache, step_mask, last_only=True)[:, -1]
            next_pos = next_pos + 1
        return responses, logprobs, reasons, versions


# name -> "module:class"; imported when built, so naming an engine (config validation) never
# imports megatron-core, which the TP-sharded engine needs for its process groups.
ENGINES = {
    "torch": "megatron_rl.rollout.engine:TorchRolloutEngine",
    "tp_sharded": "megatron_rl.rollout.tp_engine:TPShardedRolloutEngine",
    "megatron": "megatron_rl.rollout.megatron_engine:MegatronRolloutEngine",
}


def engine_class(name: str) -> type:
    """The class registered as ``name`` in :data:`ENGINES`."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known: {sorted(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(name: str, *args, **kwargs) -> RolloutEngine:
    """Build the engine registered as ``name`` (e.g. ``make_engine("torch", model_cfg, device)``)."""
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
    from megatron_rl.rollout.choice import MEGATRON, engine_facts, pick_engine

    name = pick_engine(rollout.engine, **engine_facts(model_cfg, torch.device(device).type == "cuda"))
    options = {}
    if name == MEGATRON:
        options = dict(kv_cache_memory=rollout.kv_cache_memory, prefill_chunk_tokens=rollout.prefill_chunk_tokens,
                       kv_block_tokens=rollout.kv_block_tokens, record_routing=record_routing,
                       layout=rollout.layout, prefix_caching=rollout.prefix_caching)
    return make_engine(name, model_cfg, device=device, max_batch_size=rollout.max_batch_size, **options)
