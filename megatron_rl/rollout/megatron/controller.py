"""megatron's text-generation controller with the project's sampler, stop rule and log-probs, and
the other megatron classes the dynamic engine is built from."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from megatron_rl.rollout.megatron.draws import SampleLog, keyed_draw
from megatron_rl.rollout.sampling import SamplingParams


class IdsOnly:
    """The tokenizer the controller is given: prompts arrive as ids and results leave as ids, so
    only the attributes megatron reads at the end of a request exist (no text is produced)."""

    eod = -1
    bos = None

    def detokenize(self, ids, **_kwargs) -> str:
        return ""

    def tokenize(self, text):
        raise TypeError("rollout.engine=megatron takes token ids, not text")


@functools.lru_cache(maxsize=None)
def sampling_controller_class():
    from megatron_rl.compat.inference_hooks import hooked_controller_class

    class SamplingController(hooked_controller_class()):
        """megatron's controller with the project's sampler, stop rule and log-probs.

        Per request it keeps the response tokens and log-probs on the host (across evictions,
        whose re-prefill re-enters the prompt and the tokens so far)."""

        def begin(self, params: SamplingParams, true_vocab: int, keys: dict[int, int]) -> None:
            # No controller buffer aliases the context's (rebuilt on resume): nothing to re-make.
            self.params, self.true_vocab, self.keys = params, true_vocab, keys
            self.log = SampleLog(keys, params)
            # Partial rollouts: the policy version of the weights each token is drawn with.
            # (megatron stamps its own epochs only through its inference coordinator's messages,
            # which this adapter does not run.)
            self.version: Optional[int] = None
            self.drawn_stops = None

        def draw(self, logits, request_ids: list[int], chunked_prefill_id):
            last = logits[:, : self.true_vocab]
            keys = [self.keys[r] for r in request_ids]
            tokens, logp = keyed_draw(last, self.params, keys, self.log.positions(request_ids), self.true_vocab)
            stops = []
            for rid, token, lp in zip(request_ids, tokens.tolist(), logp.tolist()):
                if rid == chunked_prefill_id:  # a prompt chunk: its token is discarded
                    stops.append(False)
                    continue
                self.log.record(rid, token, lp, self.version)
                stops.append(self.log.stop_rule_ends(rid))
            return tokens, torch.tensor(stops, dtype=torch.bool)

        @staticmethod
        def detokenize(tokenizer, tokens, remove_EOD: bool = True, skip_special_tokens: bool = True) -> str:
            # Results leave as ids: the engine detokenizes every finished request's prompt and
            # response, and megatron's version inspects the tokenizer's signature each time.
            return ""

    return SamplingController


@functools.lru_cache(maxsize=None)
def request_params_class():
    """megatron's ``SamplingParams`` whose per-request copy is shallow: every request deep-copies its
    parameters (``DynamicInferenceRequest.__post_init__``), about 0.1 ms each on the CPU, and the
    engine only ever reassigns their top-level fields."""
    import copy
    import dataclasses

    from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling

    @dataclasses.dataclass
    class RequestParams(MegatronSampling):
        def __deepcopy__(self, memo):
            return copy.copy(self)

    return RequestParams


def padded_context_class(token_rounder: int):
    """Steps padded to ``token_rounder`` tokens, and a prefill step's requests to at most as many:
    megatron pads them to a multiple of 4, which on the CPU (rounder 1) only adds empty requests."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    request_rounder = min(token_rounder, DynamicInferenceContext.REQUEST_ROUNDER)
    rounders = {"TOKEN_ROUNDER": token_rounder, "REQUEST_ROUNDER": request_rounder}
    return type("PaddedTo%dContext" % token_rounder, (DynamicInferenceContext,), rounders)
