"""Whether a training micro-batch keeps its fp32 logits for the backward pass: one rule, read by
the log-prob op (:mod:`megatron_rl.ops.logprob`) and the memory planner, so what runs and what is
planned agree.  Plain Python: the planner imports it without torch's ops."""

from __future__ import annotations

# The default of batch.logprob_keep_logits_gib, in bytes.
DEFAULT_KEEP_LOGITS_BYTES = 2**30


def keeps_logits(tokens: int, vocab_local: int, keep_logits_bytes: float) -> bool:
    """Whether ``tokens`` tokens keep their fp32 ``[tokens, vocab/TP]`` logits for backward (rather
    than recomputing them chunk by chunk): when they take at most ``keep_logits_bytes``."""
    return keep_logits_bytes > 0 and tokens * vocab_local * 4 <= keep_logits_bytes
