"""What each RL model computes from the decoder's final hidden states.

* :class:`LogProbHead` (actor, reference): log-prob of the next token and the entropy of the
  distribution at each position, from vocab-parallel output weights in chunks (never
  ``[tokens, vocab]``).
* :class:`ValueHead` (critic): ``Linear(hidden, 1)`` in fp32 on the last pipeline stage.  Under
  sequence parallelism each TP rank sees a different slice of the sequence, so its parameters
  are marked ``sequence_parallel`` and megatron sums their gradients over TP; without that mark
  the head drifts apart between TP ranks.

Both return per-token tensors shaped like the micro-batch's ``tokens`` (``[B, S]``).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_rl.distributed.runtime import active_groups
from megatron_rl.ops.logits_memory import DEFAULT_KEEP_LOGITS_BYTES
from megatron_rl.ops.logprob import DEFAULT_CHUNK_SIZE, logprob_temperature, vocab_parallel_logprobs


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, sequence_parallel: bool):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)
        for param in self.linear.parameters():
            param.sequence_parallel = sequence_parallel
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h]`` hidden states -> ``[b, s]`` fp32 values."""
        values = self.linear(hidden.float()).squeeze(-1)
        if self.sequence_parallel and active_groups().tp.size() > 1:
            # Every TP rank computes the loss on the full sequence: the gather's backward keeps
            # only this rank's slice of the gradient (no sum), exactly once per token.
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values.transpose(0, 1)


def attach_value_head(chunks: list) -> list:
    """Give the last-stage chunk a value head and freeze its (unused) LM output layer."""
    for chunk in chunks:
        if chunk.post_process:
            chunk.value_head = ValueHead(chunk.config.hidden_size, chunk.config.sequence_parallel).to(
                next(chunk.parameters()).device
            )
            if not chunk.share_embeddings_and_output_weights:
                chunk.output_layer.weight.requires_grad_(False)
    return chunks


@dataclasses.dataclass(frozen=True)
class LogProbHead:
    """``temperature`` is the rollout's sampling temperature; 0 (greedy) scores at temperature 1,
    the sampler's definition (:func:`megatron_rl.ops.logprob.logprob_temperature`).
    ``keep_logits_bytes``: a training micro-batch keeps its fp32 logits for backward up to this
    size per rank (``batch.logprob_keep_logits_gib``), else recomputes them."""

    temperature: float = 1.0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    with_entropy: bool = True
    keep_logits_bytes: float = DEFAULT_KEEP_LOGITS_BYTES
    outputs = ("logprob", "entropy")

    def __call__(self, model, hidden: torch.Tensor, tensors: dict) -> dict:
        logp, entropy = vocab_parallel_logprobs(
            hidden, model.output_weight(), tensors["labels"],
            true_vocab_size=model.true_vocab_size, temperature=logprob_temperature(self.temperature),
            chunk_size=self.chunk_size, sequence_parallel=model.config.sequence_parallel,
            with_entropy=self.with_entropy, keep_logits_bytes=self.keep_logits_bytes,
            tp_group=getattr(active_groups(), "tp", None),  # None before any layout: one rank
        )
        out = {"logprob": logp}
        if self.with_entropy:
            out["entropy"] = entropy
        return out


def logprob_head(cfg, *, temperature: float | None = None, with_entropy: bool = True) -> LogProbHead:
    """The head the config asks for: the rollout's temperature (unless given), ``batch.logprob_chunk_size``
    and ``batch.logprob_keep_logits_gib``."""
    return LogProbHead(temperature=cfg.rollout.temperature if temperature is None else temperature,
                       chunk_size=cfg.batch.logprob_chunk_size, with_entropy=with_entropy,
                       keep_logits_bytes=cfg.batch.logprob_keep_logits_gib * 2**30)


@dataclasses.dataclass(frozen=True)
class ValueOutput:
    outputs = ("value",)

    def __call__(self, model, hidden: torch.Tensor, tensors: dict) -> dict:
        return {"value": model.value_head(hidden)}
