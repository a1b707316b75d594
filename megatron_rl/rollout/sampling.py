"""Sampling parameters and the token sampler shared by rollout engines.

The sampler returns, with each token, its log-probability under the temperature-scaled *full*
distribution (before top-k / top-p).  That is what the trainer recomputes from the same weights
(``megatron_rl.ops.logprob`` divides logits by the temperature and never truncates), so the two
can be compared and their mismatch logged.  Filtering only shapes which token is drawn.
Temperature 0 is greedy decoding, reported at temperature 1 by both (one rule,
:func:`megatron_rl.ops.logprob.logprob_temperature`).

Randomness comes from an explicit ``torch.Generator``: the same seed on the same device, with
the same inputs, draws the same tokens.  Or from :func:`keyed_exponentials`, noise that is a pure
function of (sample key, response position, token id): then a sample's draws do not depend on
which other samples share its batch or step, so an engine that schedules requests dynamically
(``rollout.engine=megatron``) reproduces a seed whatever its KV budget or batch composition.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_rl.ops.logprob import logprob_temperature


@dataclass(frozen=True)
class SamplingParams:
    """How to draw responses.  ``temperature == 0`` or ``greedy=True`` means argmax."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    n: int = 1  # samples per prompt
    stop_token_ids: tuple[int, ...] = ()  # e.g. EOS; the stop token is kept in the response
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token-id sequences, kept in the response
    greedy: bool = False

    def __post_init__(self):
        # Accept lists from configs; store hashable tuples.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        sequences = tuple(tuple(int(t) for t in seq) for seq in self.stop_sequences)
        object.__setattr__(self, "stop_sequences", sequences)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1 or self.n < 1:
            raise ValueError(f"max_new_tokens and n must be >= 1, got {self.max_new_tokens}, {self.n}")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the reported log-probs: the sampling one, or 1 for greedy at T=0."""
        return logprob_temperature(self.temperature)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set everything below the k-th largest logit of each row to -inf (k=0: unchanged)."""
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p`` (nucleus)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already reach p; the top one always stays.
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with top-k then top-p applied."""
    scaled = logits.float() / params.logprob_temperature
    return top_p_filter(top_k_filter(scaled, params.top_k), params.top_p)


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``[b, vocab]`` logits: ``(tokens [b], logprobs [b] fp32)``.

    ``noise``: ``[b, vocab]`` Exp(1) draws to race with (e.g. :func:`keyed_exponentials`) instead
    of drawing them from ``generator``."""
    logits = logits.float()
    logp_full = torch.log_softmax(logits / params.logprob_temperature, dim=-1)
    if params.is_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = torch.softmax(filter_logits(logits, params), dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, without a host sync.
        if noise is None:
            race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-30)
        else:
            race = noise.to(probs).clamp_min(1e-30)
        tokens = (probs / race).argmax(dim=-1)
    return tokens, logp_full.gather(-1, tokens[:, None]).squeeze(-1)


# -- counter-based noise -------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for ``x`` in ``[0, 2**32)`` with every product below ``2**48`` (no
    int64 overflow); works on Python ints and int64 tensors alike."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32


def hash32(x):
    """A 32-bit integer mixer (Wellons' lowbias32) on ``[0, 2**32)`` values, ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sample_key(seed: int) -> int:
    """The 32-bit key of a sample whose stream is ``seed`` (any non-negative int, e.g. from
    :func:`megatron_rl.utils.seeds.derive_seed`)."""
    return hash32(hash32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))


@functools.lru_cache(maxsize=16)
def _token_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """The token ids' half of the keyed noise, the same for every draw (computed once per vocabulary:
    a decode step draws for every row at once, and this is a third of its hashing)."""
    with torch.inference_mode(False):  # a plain tensor, usable in and out of inference mode
        return hash32(torch.arange(vocab, device=device, dtype=torch.long) ^ 0x9E3779B9)


def keyed_exponentials(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[b, vocab]`` fp32 Exp(1) draws, a pure function of each row's ``(key, position)`` and the
    token id.  ``keys``: :func:`sample_key` values; ``positions``: index of the token being drawn
    in each row's response."""
    rows = hash32(hash32(keys.long() & _MASK32) ^ (positions.long() & _MASK32))
    bits = hash32(rows[:, None] ^ _token_hashes(vocab, keys.device)[None, :])
    uniform = (bits.double() + 0.5) * 2.0**-32  # in (0, 1)
    return (-torch.log(uniform)).float()


def eos_token_ids(tokenizer, hf_dir: str | None = None) -> tuple[int, ...]:
    """Every id that ends a response: the tokenizer's EOS, and the ``eos_token_id`` of the model's
    ``generation_config.json`` (one id or a list, e.g. Llama-3's end-of-text and end-of-turn).
    ``tokenizer`` None (a model saved without one, generating from ids): the latter alone."""
    import json
    import os

    ids = [int(tokenizer.eos_id)] if tokenizer is not None else []
    path = os.path.join(hf_dir, "generation_config.json") if hf_dir else None
    if path and os.path.isfile(path):
        with open(path) as fh:
            extra = json.load(fh).get("eos_token_id")
        for token in extra if isinstance(extra, list) else [extra]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return tuple(ids)
