"""The inference wrapper both batching modes run the actor's model through."""

from __future__ import annotations

import contextlib
import functools


@functools.lru_cache(maxsize=None)
def actor_wrapper_class():
    """``GPTInferenceWrapper`` whose last stage turns ``RLGPTModel``'s hidden states into logits
    with ``GPTModel``'s own output step (last tokens only, SP gather, TP gather)."""
    from megatron_rl.compat.inference_hooks import hooked_wrapper_class, postprocess_hidden_states
    from megatron_rl.models.gpt import RLGPTModel

    class ActorInferenceWrapper(hooked_wrapper_class()):
        @contextlib.contextmanager
        def around_forward(self, dummy: bool):
            from megatron_rl.models.moe import inference_token_map

            state = getattr(self.model, "moe_state", None)
            # An idle expert-parallel rank's dummy step (one dummy request with no id) records nothing.
            recording = state is not None and state.mode == "rollout" and not dummy
            if recording:  # MoE routing recorded for replay: which request and position each token is
                tokens = inference_token_map(self.inference_context, state.rollout_lengths)
                for router in state.routers:
                    router.tokens = tokens
            if not dummy and self.inference_context.is_dynamic_batching():
                # the prompt tokens this step computes (a decode request runs one token)
                ctx = self.inference_context
                self.prefill_tokens += int(ctx.active_token_count) - int(ctx.num_decode_requests)
            try:
                yield
            finally:
                if recording:
                    for router in state.routers:
                        router.tokens = None

        def output_of(self, out):
            model = self.model
            if not isinstance(model, RLGPTModel) or not model.post_process:
                return out
            return postprocess_hidden_states(model, out, self.inference_context)

    return ActorInferenceWrapper
