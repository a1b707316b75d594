"""Where the rollout engine reaches into megatron-core's inference through private names.

megatron-core 0.19.2 offers no public hook for what ``rollout.engine=megatron`` changes: the
wrapper's forward (our model returns hidden states; MoE routing is recorded around it), the
controller's sampling and termination steps (our sampler and stop rule), and the process-wide
scratch buffers grown while generating.  Each private name is used here only, behind a base
class or a function, and recorded below; ``megatron_rl/rollout/megatron/`` builds on them.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from megatron_rl.compat.records import MEGATRON_TESTED, Workaround, register_workaround


def drop_inference_buffers() -> None:
    """Forget megatron's process-wide scratch buffers (``GlobalMemoryBuffer``: the sequence-parallel
    all-gather's among them) that were grown while generating: made under ``torch.inference_mode``,
    they are inference tensors, and the training forward writing into them raises.  Training grows
    its own again on first use."""
    from megatron.core import parallel_state as ps

    buffers = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None)
    if buffers is None:
        return
    for key in [k for k, t in buffers.buffer.items() if t is not None and t.is_inference()]:
        del buffers.buffer[key]


def postprocess_hidden_states(model, hidden_states, inference_context):
    """``GPTModel``'s own output step on ``model``'s hidden states: last tokens only, the
    sequence-parallel gather, the TP gather."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel._postprocess(
        model, hidden_states=hidden_states, input_ids=None, position_ids=None, labels=None,
        rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
        inference_context=inference_context, runtime_gather_output=True,
    )


@functools.lru_cache(maxsize=None)
def hooked_wrapper_class():
    """``GPTInferenceWrapper`` whose forward runs inside ``around_forward(dummy)`` and returns
    ``output_of(hidden states)``; ``dummy``: an idle expert-parallel rank's dummy step."""
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    class HookedInferenceWrapper(GPTInferenceWrapper):
        def around_forward(self, dummy: bool):
            return contextlib.nullcontext()

        def output_of(self, out):
            return out

        def _forward(self, inference_input):
            dummy = getattr(self.inference_context, "_bookkeeping_no_real_work", False)
            with self.around_forward(dummy):
                out = super()._forward(inference_input)
            return self.output_of(out)

    return HookedInferenceWrapper


@functools.lru_cache(maxsize=None)
def hooked_controller_class():
    """megatron's ``TextGenerationController`` whose dynamic step draws with ``draw(logits,
    request ids, chunked-prefill request id) -> (tokens, stops)``: one row of logits per active
    request in slot order; a request whose ``stops`` entry is True ends on the token just drawn."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class HookedController(TextGenerationController):
        drawn_stops = None

        def draw(self, logits, request_ids: list[int], chunked_prefill_id):
            raise NotImplementedError

        def _dynamic_step_sample_logits(self):
            ctx = self.inference_wrapped_model.inference_context
            n = ctx.total_request_count - ctx.paused_request_count
            # materialize_only_last_token_logits: one row per active request, in slot order
            logits = self._all_logits_cuda.squeeze(0)[:n]
            rids = ctx.request_ids[ctx.paused_request_count : ctx.total_request_count].tolist()
            tokens, self.drawn_stops = self.draw(logits, rids, ctx.chunked_prefill_request_id)
            self._sampled_tokens_cuda[:n] = tokens

        def _dynamic_step_context_bookkeeping(self):
            # megatron ends a request whose token equals its step's termination id (the host copy
            # of the active slots' metadata): point it at the token just drawn for the requests
            # ``draw`` ends, at -1 (never drawn) otherwise.
            ctx = self.inference_wrapped_model.inference_context
            n = ctx.total_request_count - ctx.paused_request_count
            drawn = self._sampled_tokens_cuda[:n].cpu()
            term = ctx.active_request_metadata["termination_id"]
            term[:n] = torch.where(self.drawn_stops, drawn, torch.full_like(drawn, -1)).to(term.dtype)
            return super()._dynamic_step_context_bookkeeping()

    return HookedController


register_workaround(
    Workaround(
        name="inference.wrapper_forward_hook",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "GPTInferenceWrapper has no hook around a step's forward; the engine overrides its private "
            "_forward to record MoE routing and count prefilled tokens around it, and turns RLGPTModel's "
            "hidden states into logits with GPTModel's private _postprocess (last tokens, SP and TP gathers)"
        ),
        used_in="compat/inference_hooks.py:hooked_wrapper_class; compat/inference_hooks.py:postprocess_hidden_states",
    )
)
register_workaround(
    Workaround(
        name="inference.controller_sampling_hooks",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "TextGenerationController samples and ends requests in the private _dynamic_step_sample_logits "
            "and _dynamic_step_context_bookkeeping, reading the logits from _all_logits_cuda and writing "
            "_sampled_tokens_cuda; the engine overrides both to draw with the project's sampler (keyed noise, "
            "true vocabulary, temperature-scaled log-probs) and to end requests by its stop rule"
        ),
        used_in="compat/inference_hooks.py:hooked_controller_class",
    )
)
