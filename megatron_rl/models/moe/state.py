"""The MoE state of one model: router statistics, the routing recorded for replay (from the rollout
engine or a recording pass), and the metrics read from them."""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from megatron_rl.distributed import collectives
from megatron_rl.distributed.runtime import active_groups
from megatron_rl.models.moe.router import STATS, RLTopKRouter
from megatron_rl.models.moe.tokens import token_map


class MoEState:
    """Routing replay store, the active pass and the loss statistics of one model (all its chunks)."""

    def __init__(self, routers: list["RLTopKRouter"]):
        self.routers = routers
        # None | "train" | "record" | "replay" | "forward_replay" (no grad, no losses) | "rollout"
        self.mode: Optional[str] = None
        self.rows: Optional[list[int]] = None
        self.rollout_lengths: Optional[dict[int, int]] = None  # mode "rollout": request id -> longest length
        self.tokens = 0  # real tokens of the active pass (the losses' denominator)
        self.stats = torch.zeros(2 * len(STATS), dtype=torch.float64)

    @property
    def training_pass(self) -> bool:
        return self.mode in ("train", "replay")

    @property
    def measuring(self) -> bool:
        return self.training_pass

    def reset_pass(self) -> None:
        for router in self.routers:
            router.replayed.clear()
            router.recompute.clear()

    def exchange(self) -> None:
        """Every recorded (row, position) on every rank of this pipeline stage (TP x DP x CP)."""
        group = active_groups().tp_dp_cp
        mine = {r.layer_number: r.recorded for r in self.routers}
        for part in collectives.all_gather_object(mine, group=group):
            for router in self.routers:
                for row, table in part.get(router.layer_number, {}).items():
                    have = router.recorded.get(row)
                    router.recorded[row] = table if have is None else torch.where(have >= 0, have, table)

    def clear_recorded(self) -> None:
        for router in self.routers:
            router.recorded, router.pending = {}, []


class _ChunkHook:
    """Called with each micro-batch before the chunk's forward (``microbatch_hooks``)."""

    def __init__(self, state: MoEState, routers: list, sequence_parallel: bool):
        self.state, self.routers, self.sp = state, routers, sequence_parallel

    def __call__(self, mb) -> None:
        tp = active_groups().tp
        tmap = token_map(mb, self.state.rows, tp.rank(), tp.size(), self.sp)
        for router in self.routers:
            router.tokens = tmap


def attach_moe_state(chunks: list) -> Optional[MoEState]:
    """Give the routers of ``chunks`` (one model) a shared :class:`MoEState` and each chunk a
    micro-batch hook; None for a dense model."""
    from megatron_rl.models.canonical import unwrap

    routers = []
    for chunk in chunks:
        model = unwrap(chunk)
        mine = [m for m in model.modules() if isinstance(m, RLTopKRouter)]
        routers += mine
        model.microbatch_hooks = [_ChunkHook(None, mine, model.config.sequence_parallel)] if mine else []
    if not routers:
        return None
    state = MoEState(routers)
    for chunk in chunks:
        model = unwrap(chunk)
        for hook in model.microbatch_hooks:
            hook.state = state
        model.moe_state = state
    for router in routers:
        router.state = state
    return state


def moe_state(chunks: list) -> Optional[MoEState]:
    from megatron_rl.models.canonical import unwrap

    return getattr(unwrap(chunks[0]), "moe_state", None) if chunks else None


@contextlib.contextmanager
def moe_pass(chunks: list, seqs: Sequence[dict], mode: Optional[str] = "train",
             rows: Optional[Sequence[int]] = None):
    """Around one ``run_sequences(chunks, seqs, ...)`` of an MoE model (a no-op for a dense one,
    or with ``mode=None``).

    ``train``: a training forward; the routers measure their losses (:func:`moe_metrics`) and add
    them to the gradient when their coefficients are > 0, divided by the real tokens of ``seqs``.
    ``record``: a forward (old log-probs) that stores every real token's experts for routing
    replay, exchanged on exit.  ``replay``: a ``train`` that routes every real token to its
    recorded experts.  ``forward_replay``: a forward without losses that routes the same way (the
    old-log-prob pass on routing the rollout recorded).  ``rows[i]`` names ``seqs[i]``'s sample (default ``i``): the
    key a recording is replayed by."""
    state = moe_state(chunks)
    if state is None or mode is None:
        yield state
        return
    if mode not in ("train", "record", "replay", "forward_replay"):
        raise ValueError(f"unknown MoE pass mode {mode!r}")
    if mode == "record":
        state.clear_recorded()
    state.mode, state.rows = mode, list(rows) if rows is not None else None
    state.tokens = sum(int(s["tokens"].numel()) for s in seqs)
    state.reset_pass()
    try:
        yield state
    finally:
        state.mode, state.rows, state.tokens = None, None, 0
        for router in state.routers:
            router.tokens = None
        state.reset_pass()
    if mode == "record":
        state.exchange()


@contextlib.contextmanager
def moe_rollout(model, lengths: dict[int, int]):
    """Around one generation of megatron's inference engine on ``model`` (this rank's unwrapped
    chunk): its routers record the experts of every token they route, by (request id,
    position); ``lengths[request_id]`` bounds each request.  Yields a dict filled on exit with
    ``{request_id: {layer_number: [length, topk] int16}}`` (-1 where no token was routed: a
    request's last token is sampled, never fed back).  The engine's wrapper sets each step's
    tokens (:func:`inference_token_map`).  A no-op (an empty dict) for a dense model."""
    state = getattr(model, "moe_state", None)
    out: dict = {}
    if state is None:
        yield out
        return
    state.clear_recorded()
    state.mode, state.rollout_lengths = "rollout", lengths
    try:
        yield out
    finally:
        state.mode, state.rollout_lengths = None, None
        for router in state.routers:
            router.tokens = None
    for router in state.routers:
        router.flush_recorded()
        for rid, table in router.recorded.items():
            out.setdefault(rid, {})[router.layer_number] = table
    state.clear_recorded()


def gather_rollout_routing(local: dict, sample_index: dict[int, int], reports: bool) -> dict[int, dict]:
    """Every sample's recorded routing for this pipeline stage's MoE layers, on every rank of the
    stage: ``local`` is this rank's :func:`moe_rollout` result, ``sample_index[request_id]`` the
    sample's index in the gathered batch; only ``reports`` ranks (one per generator and stage)
    send theirs.  A collective over the stage's TP x DP x CP ranks."""
    mine = {sample_index[rid]: tables for rid, tables in local.items()} if reports else {}
    merged: dict[int, dict] = {}
    group = active_groups().tp_dp_cp
    for part in collectives.all_gather_object(mine, group=group):
        merged.update(part)
    return merged


def load_routing(chunks: list, routing: Sequence[Optional[dict]]) -> bool:
    """Give the routers of ``chunks`` the recorded routing of a batch's samples (``routing[row]``:
    ``{layer_number: [length, topk]}`` or None) for the step's replaying passes.  False (nothing
    loaded) for a dense model or a batch without recordings."""
    state = moe_state(chunks)
    if state is None or not routing or any(r is None for r in routing):
        return False
    state.clear_recorded()
    for router in state.routers:
        for row, tables in enumerate(routing):
            router.recorded[row] = tables[router.layer_number]
    return True


def moe_metrics(chunks: list, prefix: str = "actor/") -> dict:
    """Token-weighted means, over every rank, of what the routers measured in the training passes
    since the last call: the load-balancing and z-losses, and the share of (token, layer) pairs
    whose own top-k differs from the replayed one.  Ends the step: the counters restart and the
    routing recorded for replay is dropped.  Every rank must call it (a collective); {} for a
    dense model."""
    state = moe_state(chunks)
    if state is None:
        return {}
    state.clear_recorded()
    local = torch.zeros(2 * len(STATS), dtype=torch.float64)
    for r in state.routers:
        local += r.stats.cpu()
        r.stats.zero_()
    total = collectives.all_reduce(local)
    out = {}
    for i, name in enumerate(STATS):
        num, den = float(total[2 * i]), float(total[2 * i + 1])
        if den > 0:
            out[f"{prefix}{'routing_replay_mismatch' if name == 'mismatch' else 'moe_' + name + '_loss'}"] = num / den
    return out
