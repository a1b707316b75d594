"""The router: megatron-core's TopKRouter with RL's losses, statistics and routing replay."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_rl.models.moe.tokens import TokenMap, map_for_count

if TYPE_CHECKING:
    from megatron_rl.models.moe.state import MoEState



# The statistics every router keeps on the device: load-balancing loss, z-loss, replay mismatch.
STATS = ("aux", "z", "mismatch")


@dataclasses.dataclass(frozen=True)
class LossSettings:
    load_balancing: str = "aux_loss"
    aux_coeff: float = 0.0
    z_coeff: float = 0.0

DEFAULT_LOSSES = LossSettings()


class _TopK(RouterReplay):
    """What ``topk_routing_with_score_function`` calls for the top-k (megatron's ``router_replay``
    interface): the router's own choice, recorded or replaced by the recording when replaying.
    Not in megatron's process-global list of instances (every model built in the process would be);
    megatron's inference engine records through it when the rollout puts it there."""

    def __init__(self, router: "RLTopKRouter"):
        self.router = router
        self.target_topk_idx = self.recorded_topk_idx = self.static_buffer = None
        self.router_replay_action, self.replay_backward_list, self.layer_number = None, [], None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.router_replay_action == RouterReplayAction.RECORD:  # megatron's inference engine records
            self.record_indices(indices)
        target = self.router.topk_for(indices)
        if target is None:
            return values, indices
        return scores.gather(1, target), target


class RLTopKRouter(TopKRouter):
    """megatron's ``TopKRouter`` with RL's loss normalisation and routing replay (module docstring)."""

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False, *,
                 losses: LossSettings = DEFAULT_LOSSES):
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.losses = losses
        self.router_replay = _TopK(self)
        self.state: Optional["MoEState"] = None
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
