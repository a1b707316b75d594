"""The per-token bookkeeping both batching modes share: each draw made with our sampler and the
keyed race noise, each drawn token recorded per sample, and the batch the samples make."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from megatron_rl.rollout.engine import RolloutBatch, stopped
from megatron_rl.rollout.sampling import SamplingParams, keyed_exponentials, sample


def keyed_draw(logits: torch.Tensor, params: SamplingParams, keys, positions, vocab: int):
    """``(tokens, log-probs)`` drawn from ``logits`` [rows, vocab] (the true vocabulary) with the
    race noise of (sample key, position): a seed gives the same samples whatever the batching."""
    noise = None
    if not params.is_greedy:
        keys = torch.as_tensor(keys, dtype=torch.long).to(logits.device)
        positions = torch.as_tensor(positions, dtype=torch.long).to(logits.device)
        noise = keyed_exponentials(keys, positions, vocab)
    return sample(logits, params, None, noise=noise)


class SampleLog:
    """Per sample: the response drawn so far, each token's log-prob and (partial rollouts) the policy
    version it was drawn with, kept on the host across evictions and re-prefills."""

    def __init__(self, sample_ids: Iterable[int], params: SamplingParams):
        self.params = params
        ids = list(sample_ids)
        self.responses: dict[int, list[int]] = {rid: [] for rid in ids}
        self.logprobs: dict[int, list[float]] = {rid: [] for rid in ids}
        self.versions: dict[int, list[int]] = {rid: [] for rid in ids}

    def positions(self, sample_ids: Iterable[int]) -> list[int]:
        """The response position each sample draws next (its noise's key)."""
        return [len(self.responses[rid]) for rid in sample_ids]

    def record(self, rid: int, token: int, logprob: float, version: Optional[int] = None) -> None:
        self.responses[rid].append(token)
        self.logprobs[rid].append(logprob)
        if version is not None:
            self.versions[rid].append(version)

    def stop_rule_ends(self, rid: int) -> bool:
        """Whether a stop id or stop sequence ended the sample on its last token."""
        return stopped(self.responses[rid], self.params)


def sampled_batch(prompt_ids: list[list[int]], samples: list[tuple[int, int]], responses: list[list[int]],
                  logprobs: list[list[float]], params: SamplingParams, **extra) -> RolloutBatch:
    """The rollout batch of ``samples`` ((prompt, sample) pairs, in request order)."""
    return RolloutBatch(
        prompt_index=[i for i, _ in samples],
        prompt_ids=[list(prompt_ids[i]) for i, _ in samples],
        response_ids=responses,
        response_logprobs=logprobs,
        finish_reason=["stop" if stopped(r, params) else "length" for r in responses],
        **extra,
    )
