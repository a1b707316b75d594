"""Static batching: megatron's ``StaticInferenceContext`` with the actor's inference wrapper, stepped
by :mod:`megatron_rl.rollout.static_batching` ``rollout.max_batch_size`` rows at a time."""

from __future__ import annotations

from megatron_rl.rollout.engine import RolloutBatch
from megatron_rl.rollout.megatron.draws import sampled_batch
from megatron_rl.rollout.megatron.modes import (
    after_generating,
    kv_cache_bytes_for,
    without_context_parallel,
    without_sequence_parallel,
)
from megatron_rl.rollout.megatron.wrapper import actor_wrapper_class
from megatron_rl.rollout.sampling import SamplingParams


class StaticBatching:
    """megatron's static batching for one :class:`~megatron_rl.rollout.megatron.engine.MegatronRolloutEngine`,
    whose ``rollout.*`` settings it reads when it generates."""

    def __init__(self, settings):
        self.settings = settings
        self.wrapper = None  # the inference wrapper, kept for its model (building one costs about a millisecond)
        self.prefill_tokens = 0  # prompt tokens the last generate computed

    def _wrapper_for(self, model, context):
        """One inference wrapper per model, pointed at each chunk's context; the model's own groups:
        an engine-own model's are not megatron's globals."""
        context.config.pg_collection = model.pg_collection
        if self.wrapper is None or self.wrapper.model is not model:
            self.wrapper = actor_wrapper_class()(model, context)
        self.wrapper.inference_context = context
        return self.wrapper

    def _rows_per_chunk(self, model, width: int) -> int:
        """``rollout.max_batch_size`` rows, fewer where a chunk's KV cache would exceed ``rollout.kv_cache_memory``."""
        from megatron_rl.rollout.static_batching import kv_bytes_per_row

        budget = kv_cache_bytes_for(self.settings.kv_cache_memory, self.settings.device)
        per_row = kv_bytes_per_row(model, width)
        if budget < per_row:
            raise ValueError(
                f"rollout.kv_cache_memory: {budget} bytes hold no sequence of {width} tokens ({per_row} bytes of "
                "KV on this rank); raise rollout.kv_cache_memory or lower rollout.max_new_tokens")
        return min(self.settings.max_requests, budget // per_row)

    def generate(self, model, prompt_ids: list[list[int]], params: SamplingParams, samples: list[tuple[int, int]],
                 keys: list[int], vocab: int) -> RolloutBatch:
        """Every sample through megatron's static-batching inference, a chunk of rows at a time."""
        from megatron.core.inference.utils import InferenceMode

        from megatron_rl.rollout.static_batching import generate_static, honours_attention_masks

        if not samples:  # a generator whose share of the prompts is empty
            return RolloutBatch([], [], [], [], [])
        was_training = model.training
        groups = model.pg_collection
        rows = self._rows_per_chunk(model, max(len(p) for p in prompt_ids) + params.max_new_tokens)
        own = model is self.settings.weights.inference_model
        cp_group = groups.cp if not own and groups.cp.size() > 1 else None
        vocab = getattr(model, "true_vocab_size", None) or vocab
        left_pad = self.settings.static_left_pad
        left_pad = left_pad if left_pad is not None else honours_attention_masks(model)
        responses, logprobs = [], []
        self.prefill_tokens = 0
        model.eval()
        try:
            with without_context_parallel(model, cp_group), without_sequence_parallel(model), InferenceMode.active():
                for start in range(0, len(samples), rows):
                    chunk = samples[start : start + rows]
                    out = generate_static(self._wrapper_for, model, prompt_ids, [i for i, _ in chunk],
                                          keys[start : start + rows], params, vocab,
                                          share_prompts=self.settings.prefix_caching, left_pad=left_pad)
                    responses += out.responses
                    logprobs += out.logprobs
                    self.prefill_tokens += out.prefill_tokens
        finally:
            InferenceMode.unset_active()
            after_generating(model, was_training)
        return sampled_batch(prompt_ids, samples, responses, logprobs, params)
