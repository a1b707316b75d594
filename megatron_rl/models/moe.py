"""Mixture of experts on megatron-core: the config mapping, our router, and routing replay.

megatron-core brings the MoE layer itself -- router, token dispatchers (alltoall, allgather),
experts (``SequentialMLP`` on the local spec, TransformerEngine's grouped GEMM on the TE spec),
shared experts, expert parallelism -- and all of it runs on CPU with gloo.  This module adds what
RL needs around it, in :class:`RLTopKRouter`, a ``TopKRouter`` swapped in through the layer spec:

* **Losses normalised like the policy loss.**  megatron's own load-balancing and z-losses assume
  its loss scaling (a count returned by the loss function, divided in ``finalize_model_grads``);
  ours divides every loss on the host by the mini-batch's token count (``engine/forward.py``), so
  megatron's are switched off and the router computes them itself: the load-balancing loss per
  micro-batch (``aux_loss``) or per sequence (``seq_aux_loss``), and the z-loss, over real tokens
  (padding excluded), weighted by tokens and divided by the tokens of the whole forward pass
  (:func:`moe_pass`).  They are always measured (``actor/moe_aux_loss``, ``actor/moe_z_loss``);
  they reach the gradient only with ``model.moe.aux_loss_coeff`` / ``z_loss_coeff`` > 0.
* **Routing replay.**  While the rollout engine (``rollout.engine=megatron``) generates, each
  router stores the experts it picked for every token it routes, keyed by (sample, position)
  (:func:`moe_rollout`); the recordings travel with the samples (:func:`gather_rollout_routing`) and
  are loaded before the step's forwards (:func:`load_routing`).  A recording pass over the finished
  samples (the old-log-prob forward) does the same where no engine recorded them.  The keys do not
  depend on how the batch was cut or laid out; a store is exchanged over the TP x DP x CP ranks of
  each pipeline stage.  A replaying pass routes every real token to its recorded experts (the
  routing weights are recomputed from the current logits at those experts, as megatron's
  ``RouterReplay`` does) and counts the tokens whose own top-k differs
  (``actor/routing_replay_mismatch``).  With full activation recompute the routers remember what
  they used in the forward and use it again when backward recomputes the layer.

The router hooks megatron-core 0.19.2 in two places: ``MoESubmodules.router`` (the router class a
spec builds) and the ``router_replay`` object ``topk_routing_with_score_function`` asks for its
top-k (:class:`_TopK`, the interface of megatron's own ``RouterReplay``, whose instances are
process-global).  Which tokens a router call sees comes from the micro-batch: ``engine/forward.py``
calls each chunk's ``microbatch_hooks`` before its forward.  The statistics stay on the device
until :func:`moe_metrics` reads them; only the recording pass copies routing to the host (one copy
per MoE layer and micro-batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional, Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.distributed import collectives
from megatron_rl.models.arch import expert_ffn_size, moe_layer_pattern

ROUTER_DTYPES = {"float32": "fp32", "float64": "fp64", "model": None}
# The stats every router accumulates between two calls of moe_metrics: (numerator, denominator)
# pairs, summed over all ranks.
STATS = ("aux", "z", "mismatch")


def moe_transformer_kwargs(model_cfg, layout, impl: str) -> dict:
    """``TransformerConfig`` fields of ``model_cfg.moe`` (empty for a dense model).

    megatron's own auxiliary and z-losses stay off: :class:`RLTopKRouter` computes them."""
    moe = model_cfg.moe
    if not moe.num_experts:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=expert_ffn_size(model_cfg),
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=bool(moe.shared_expert_gate and moe.shared_expert_ffn_hidden_size),
        moe_router_score_function=moe.score_function,
        # softmax then top-k, kept as they are == no renormalisation; top-k of the logits then a
        # softmax over them == the chosen experts' softmax scores renormalised to 1.
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.topk_norm,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_router_dtype=ROUTER_DTYPES[moe.router_dtype],
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_token_dispatcher_type=moe.token_dispatcher,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_drop_policy=moe.token_drop_policy,
        moe_layer_freq=moe_layer_pattern(model_cfg),
        moe_grouped_gemm=impl == "transformer_engine",
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )


@dataclasses.dataclass(frozen=True)
class LossSettings:
    load_balancing: str = "aux_loss"
    aux_coeff: float = 0.0
    z_coeff: float = 0.0


def router_class(model_cfg):
    """The router for ``MoESubmodules.router``: :class:`RLTopKRouter` with this model's losses."""
    moe = model_cfg.moe
    return functools.partial(RLTopKRouter, losses=LossSettings(moe.load_balancing, moe.aux_loss_coeff,
                                                               moe.z_loss_coeff))


# ----------------------------------------------------------------------------- which tokens a router sees


@dataclasses.dataclass
class TokenMap:
    """The real tokens among the ones a router call sees, in the router's order: sequence ``j`` of
    the micro-batch owns tokens ``index[j]`` at sequence positions ``positions[j]``.  ``full`` is the
    map of this rank's whole CP shard when the router sees a sequence-parallel slice of it."""

    count: int  # tokens the router sees (padding included)
    real: torch.Tensor  # bool [count]
    seq: torch.Tensor  # long [count]: index of the token's sequence; -1 for padding
    rows: list[int]  # each sequence's sample row (from the active pass), or its index in the call
    lengths: list[int]
    index: list[torch.Tensor]
    positions: list[torch.Tensor]
    pos: torch.Tensor  # long [count]: every token's position in its sequence, in the router's order
    full: Optional["TokenMap"] = None
    _on_device: dict = dataclasses.field(default_factory=dict)

    def real_on(self, device) -> torch.Tensor:
        """``real`` on ``device``, copied once per micro-batch (not per layer)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = self.real.to(device)
        return self._on_device[key]


def _map_of(seq, pos, real, rows, lengths) -> TokenMap:
    seq = torch.where(real, seq, torch.full_like(seq, -1))
    index = [torch.nonzero(seq == j).reshape(-1) for j in range(len(lengths))]
    return TokenMap(int(seq.numel()), real, seq, rows, lengths, index, [pos[i] for i in index], pos)


def _sequence_parallel_slice(full: TokenMap, seq, pos, real, tp_rank: int, tp_size: int) -> TokenMap:
    """``full``'s tokens that TP rank ``tp_rank`` sees under sequence parallelism (a contiguous
    slice of the flattened tokens), with ``full`` attached."""
    per = pos.numel() // tp_size
    part = slice(tp_rank * per, (tp_rank + 1) * per)
    sliced = _map_of(seq[part], pos[part], real[part], full.rows, full.lengths)
    sliced.full = full
    return sliced


def token_map(mb, rows: Optional[Sequence[int]], tp_rank: int, tp_size: int, sequence_parallel: bool) -> TokenMap:
    """Where a router's tokens come from, for micro-batch ``mb`` (a ``data.microbatch.Microbatch``).

    The router sees the decoder's ``[s, b]`` tokens flattened s-major; under sequence parallelism
    only this TP rank's contiguous slice of them."""
    pos = mb.tensors["position_ids"]
    if mb.packed:
        sizes = [p // mb.cp_size for p in mb.padded_lengths]
        seq = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        pos = pos.reshape(-1)
    else:
        b, s = pos.shape
        seq = torch.arange(b)[:, None].expand(b, s).t().reshape(-1)
        pos = pos.t().reshape(-1)
    lengths = list(mb.lengths)
    real = pos < torch.tensor(lengths)[seq]
    picked = [rows[i] for i in mb.seq_indices] if rows is not None else list(mb.seq_indices)
    full = _map_of(seq, pos, real, picked, lengths)
    if not (sequence_parallel and tp_size > 1):
        return full
    return _sequence_parallel_slice(full, seq, pos, real, tp_rank, tp_size)


def inference_token_map(ctx, lengths: dict[int, int]) -> TokenMap:
    """Where a router's tokens come from in one step of megatron's dynamic inference engine
    (context ``ctx``): the step's flat tokens belong to request slots, ``lengths[request_id]`` is
    the longest that request can grow (its recording's size).  Padding to the step's rounded
    size is not real."""
    count = int(ctx.padded_active_token_count)
    active = int(ctx.active_token_count)
    slots = ctx.token_to_request_idx[:count].to("cpu", torch.long)
    pos = ctx.token_to_position_in_request[:count].to("cpu", torch.long)
    real = torch.arange(count) < active
    slots = torch.where(real, slots, torch.zeros_like(slots))
    requests = int(ctx.total_request_count)
    rows = ctx.request_ids[:requests].tolist()
    return _map_of(slots, pos, real, rows, [lengths[r] for r in rows])


def map_for_count(tmap: Optional[TokenMap], count: int) -> Optional[TokenMap]:
    """``tmap`` as a router of ``count`` tokens sees it: whole, or this TP rank's sequence-parallel
    slice of it when the router sees ``1/TP`` of the tokens (the inference engine decides per
    layer type); None when neither fits (e.g. an idle expert-parallel rank's dummy forward)."""
    if tmap is None or tmap.count == count:
        return tmap
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1 and tmap.count == count * tp:
        return _sequence_parallel_slice(tmap, tmap.seq, tmap.pos, tmap.real, ps.get_tensor_model_parallel_rank(), tp)
    return None


# ----------------------------------------------------------------------------- state of one model


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
        group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
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
        tmap = token_map(mb, self.state.rows, ps.get_tensor_model_parallel_rank(),
                         ps.get_tensor_model_parallel_world_size(), self.sp)
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
    group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
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


# ----------------------------------------------------------------------------- the router


class _TopK:
    """What ``topk_routing_with_score_function`` calls for the top-k (megatron's ``router_replay``
    interface): the router's own choice, recorded or replaced by the recording when replaying."""

    def __init__(self, router: "RLTopKRouter"):
        self.router = router

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.router.topk_for(indices)
        if target is None:
            return values, indices
        return scores.gather(1, target), target


class RLTopKRouter(TopKRouter):
    """megatron's ``TopKRouter`` with RL's loss normalisation and routing replay (module docstring)."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False, *,
                 losses: LossSettings = LossSettings()):
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.losses = losses
        self.router_replay = _TopK(self)
        self.state: Optional[MoEState] = None
        self.tokens: Optional[TokenMap] = None  # set by the micro-batch hook before each forward
        self.recorded: dict[int, torch.Tensor] = {}  # sample row -> [length, topk] expert ids, -1 unknown
        # Rollout: each step's top-k, copied to the host without waiting; written into ``recorded``
        # once the rollout ends (flush_recorded), so a decode step does not sync per MoE layer.
        self.pending: list[tuple[TokenMap, torch.Tensor]] = []
        # Full recompute: what each checkpointed forward saw and routed to, for backward's re-run.
        self.recompute: list[Optional[TokenMap]] = []
        self.replayed: list[torch.Tensor] = []
        self._kind, self._now = "normal", None
        self.stats = torch.zeros(2 * len(STATS), dtype=torch.float64)

    # -- which call is this -------------------------------------------------------------------
    def _map(self, count: int) -> Optional[TokenMap]:
        tmap = self.tokens
        if tmap is not None and tmap.count != count:
            raise RuntimeError(f"MoE router {self.layer_number}: sees {count} tokens, the micro-batch gives it "
                               f"{tmap.count}; the micro-batch hook and the model disagree")
        return tmap

    def _call(self, count: int) -> tuple[str, Optional[TokenMap]]:
        """``(kind, tokens)`` of this call: ``recompute`` (backward re-running a checkpointed
        forward of a training pass under full recompute: the tokens that forward saw, not the
        current micro-batch's), ``checkpointed`` (that forward, run without grad) or ``normal``."""
        state = self.state
        if state is None or state.mode is None:
            return "normal", None
        if state.mode == "rollout":
            return "normal", map_for_count(self.tokens, count)
        if state.training_pass and torch.is_grad_enabled() and self.recompute:
            return "recompute", self.recompute.pop(0)
        tmap = self._map(count)
        if (state.training_pass and self.training and not torch.is_grad_enabled()
                and self.config.recompute_granularity == "full"):
            self.recompute.append(tmap)
            return "checkpointed", tmap
        return "normal", tmap

    # -- record / replay ----------------------------------------------------------------------
    def topk_for(self, computed: torch.Tensor) -> Optional[torch.Tensor]:
        """The experts to route to instead of ``computed`` (this call's own top-k), or None."""
        mode = self.state.mode if self.state else None
        if mode not in ("record", "replay", "forward_replay", "rollout"):
            return None
        if self._kind == "recompute":
            return self.replayed.pop(0) if mode == "replay" else None
        tmap = self._now
        if tmap is None:
            if mode == "rollout":
                return None  # a step without requests (an idle expert-parallel rank's dummy forward)
            raise RuntimeError("routing replay needs the micro-batch hook that engine/forward.py runs")
        if mode in ("record", "rollout"):
            self._record(tmap, computed)
            return None
        target = computed.clone()
        known = tmap.real.clone()
        for j, row in enumerate(tmap.rows):
            idx = tmap.index[j]
            if idx.numel() == 0:
                continue
            table = self.recorded.get(row)
            if table is None:
                raise RuntimeError(f"routing replay: sample row {row} was not recorded (layer {self.layer_number})")
            got = table[tmap.positions[j]]
            unknown = (got < 0).any(-1)
            if bool(unknown.any()):
                # Only a sequence's last token may lack a recording: the engine samples it and never
                # feeds it back, and its output predicts nothing.  It routes by its own top-k.
                if bool((tmap.positions[j][unknown] != tmap.lengths[j] - 1).any()):
                    raise RuntimeError(f"routing replay: sample row {row} has unrecorded positions "
                                       f"(layer {self.layer_number})")
                known[idx[unknown]] = False
                got = torch.where(unknown[:, None], computed[idx.to(computed.device)].to(got), got)
            target[idx.to(target.device)] = got.to(target)
        real = known.to(computed.device)
        differs = (computed.sort(-1).values != target.sort(-1).values).any(-1) & real
        self._add("mismatch", differs.sum(), real.sum())
        if self._kind == "checkpointed":
            self.replayed.append(target)
        return target

    def _record(self, tmap: TokenMap, computed: torch.Tensor) -> None:
        if tmap.full is not None:  # sequence parallel: record the whole CP shard on every TP rank
            computed = gather_from_sequence_parallel_region(computed, group=self.tp_group)
            tmap = tmap.full
        if self.state is not None and self.state.mode == "rollout":
            self.pending.append((tmap, computed.to(torch.int16).to("cpu", non_blocking=True)))
            return
        self._write(tmap, computed.to("cpu", torch.int16))

    def flush_recorded(self) -> None:
        """Write the rollout's pending top-k into ``recorded``, in step order (a request evicted and
        prefilled again keeps its last routing), after one wait for their copies."""
        if any(picked.is_pinned() for _, picked in self.pending):  # copies from a GPU still in flight
            torch.cuda.synchronize()
        for tmap, picked in self.pending:
            self._write(tmap, picked)
        self.pending = []

    def _write(self, tmap: TokenMap, picked: torch.Tensor) -> None:
        for j, row in enumerate(tmap.rows):
            idx = tmap.index[j]
            if idx.numel() == 0:
                continue
            table = self.recorded.get(row)
            if table is None:
                table = self.recorded[row] = torch.full((tmap.lengths[j], picked.shape[1]), -1, dtype=torch.int16)
            table[tmap.positions[j]] = picked[idx]

    # -- losses --------------------------------------------------------------------------------
    def _add(self, name: str, num: torch.Tensor, den: torch.Tensor) -> None:
        """Accumulate on the device the values came from (no host sync per layer)."""
        if self.stats.device != num.device:
            self.stats = self.stats.to(num.device)
        i = 2 * STATS.index(name)
        self.stats[i] += num.detach().to(self.stats.dtype)
        self.stats[i + 1] += den.detach().to(self.stats.dtype)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        flat = logits.reshape(-1, self.config.num_moe_experts)
        self._kind, self._now = self._call(flat.shape[0])
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        state, tmap = self.state, self._now
        if state is None or not state.measuring:
            return probs, routing_map
        real = tmap.real_on(flat.device) if tmap is not None else torch.ones(flat.shape[0], dtype=torch.bool,
                                                                             device=flat.device)
        grad = self.training and torch.is_grad_enabled()
        measure = self._kind != "recompute"  # once per forward, not again when backward re-runs it
        attach = []
        if self.losses.load_balancing != "none" and (measure or (grad and self.losses.aux_coeff > 0)):
            aux = self._load_balancing(flat, routing_map, real, tmap)
            if measure:
                self._add("aux", aux, real.sum())
            if grad and self.losses.aux_coeff > 0:
                attach.append(self.losses.aux_coeff * aux / max(state.tokens, 1))
        if measure or (grad and self.losses.z_coeff > 0):
            z = (torch.logsumexp(flat.float(), dim=-1).square() * real).sum()
            if measure:
                self._add("z", z, real.sum())
            if grad and self.losses.z_coeff > 0:
                attach.append(self.losses.z_coeff * z / max(state.tokens, 1))
        if attach:
            probs = MoEAuxLossAutoScaler.apply(probs, sum(attach))
        return probs, routing_map

    def _scores(self, flat: torch.Tensor) -> torch.Tensor:
        """Every expert's score for the load-balancing loss (all experts, normalised per token)."""
        if self.score_function == "softmax":
            return torch.softmax(flat.float(), dim=-1)
        s = torch.sigmoid(flat.float())
        return s / (s.sum(-1, keepdim=True) + 1e-20)

    def _load_balancing(self, flat, routing_map, real, tmap) -> torch.Tensor:
        """``sum over groups g of T(g) LB(g)``, this rank's share (the sum over the TP x CP ranks is
        the whole), where a group is the micro-batch (``aux_loss``) or one sequence
        (``seq_aux_loss``) and ``LB = E / (k T^2) sum_e P_e f_e`` (Switch Transformer: ``P_e`` the
        scores summed over the group's ``T`` real tokens, ``f_e`` how many of them went to ``e``)."""
        experts, k = self.config.num_moe_experts, self.topk
        scores = self._scores(flat) * real[:, None]
        routed = routing_map.float() * real[:, None]
        if self.losses.load_balancing == "seq_aux_loss" and tmap is not None:
            groups, group = len(tmap.rows), tmap.seq.to(flat.device).clamp(min=0)
        else:
            groups, group = 1, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
        counts = torch.zeros(groups, experts + 1, dtype=torch.float32, device=flat.device)
        counts.index_add_(0, group, torch.cat([routed, real[:, None].float()], dim=1))
        counts = reduce_from_tensor_model_parallel_region(counts, group=self.tp_cp_group)
        f, tokens = counts[:, :experts], counts[:, experts]
        p = torch.zeros(groups, experts, dtype=scores.dtype, device=flat.device).index_add(0, group, scores)
        return (experts / k * (p * f).sum(-1) / tokens.clamp(min=1)).sum()
