"""K/V cache bytes: one count for the planner, resolution and the engines' budgets."""

from __future__ import annotations

from megatron_rl.layout.arch import attention_dims


def kv_bytes(model, tokens: int, bytes_per: int = 2, tp: int = 1, pp: int = 1) -> float:
    """K and V of ``tokens`` token positions on one rank of a ``tp`` x ``pp`` model: the layers of
    its pipeline stage and its TP share of the KV heads (``tp = pp = 1``: the whole model)."""
    _, nkv, d = attention_dims(model)
    per_token = 2 * model.num_layers / pp * nkv / tp * d * bytes_per
    return per_token * tokens


def stage_kv_bytes(model, tokens: int, bytes_per: int, *, layers: int, tp: int) -> int:
    """K and V of ``tokens`` positions as megatron allocates them on a built rank: its stage's
    ``layers`` and its TP share of the KV heads, at least one (heads are replicated when ``tp``
    exceeds them).  Exact, for an engine's budget; :func:`kv_bytes` is the planner's estimate."""
    _, nkv, d = attention_dims(model)
    return 2 * layers * tokens * max(nkv // tp, 1) * d * bytes_per
