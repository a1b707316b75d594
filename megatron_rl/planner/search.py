"""Search parallel layouts for one that fits, and the smallest cluster when none does."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Optional

from megatron_rl.config.schema import ModelConfig, MoEConfig, RolloutLayoutConfig
from megatron_rl.data.microbatch import align_to, alignment
from megatron_rl.layout.arch import is_moe
from megatron_rl.layout.lora import int8_base
from megatron_rl.layout.rules import PP_RULES, TP_RULES, a2a_heads_ok, problems, training_problems
from megatron_rl.layout.sizes import ParallelLayout
from megatron_rl.planner import moe
from megatron_rl.planner.memory import Breakdown, GiB, estimate, teacher_option
from megatron_rl.planner.option import PlanOption, format_value

# Usable fraction of GPU memory: the rest goes to the CUDA context, NCCL buffers, fragmentation.
HEADROOM = 0.9
HEADROOM_NOTE = "the rest for the CUDA context, NCCL buffers, fragmentation"
# Sizes tried for each of TP, PP and CP: powers of two up to 64.
PARALLEL_SIZES = (1, 2, 4, 8, 16, 32, 64)
# TP stays inside a node, on at most this many GPUs (one NVLink domain).
MAX_TP = 8
# When no layout fits, the largest cluster (nodes) searched for the smallest one that does.
MAX_SEARCH_NODES = 64

PRESETS = {
    "qwen2.5-0.5b": dict(num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14,
                         num_query_groups=2, vocab_size=151936, add_qkv_bias=True, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                         num_query_groups=2, vocab_size=151936, add_qkv_bias=True, tie_word_embeddings=True),
    "qwen2.5-7b": dict(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                       num_query_groups=4, vocab_size=152064, add_qkv_bias=True),
    "qwen2.5-14b": dict(num_layers=48, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                        num_query_groups=8, vocab_size=152064, add_qkv_bias=True),
    "qwen2.5-32b": dict(num_layers=64, hidden_size=5120, ffn_hidden_size=27648, num_attention_heads=40,
                        num_query_groups=8, vocab_size=152064, add_qkv_bias=True),
    "llama3-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                      num_query_groups=8, vocab_size=128256),
    "llama3-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                       num_query_groups=8, vocab_size=128256),
    "qwen3-30b-a3b": dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                          num_query_groups=4, kv_channels=128, vocab_size=151936, qk_layernorm=True,
                          moe=MoEConfig(num_experts=128, router_topk=8, ffn_hidden_size=768)),
}


def preset(name: str) -> ModelConfig:
    return ModelConfig(**PRESETS[name])


@dataclasses.dataclass
class Candidate:
    layout: PlanOption
    tokens_per_rank: int
    breakdown: Breakdown
    fits: bool

    @property
    def total_gib(self) -> float:
        return self.breakdown.total / GiB

    def batch_settings(self) -> dict:
        """The token budget per micro-batch, the rollout's batch, its KV-cache bytes and the inference layout."""
        infer = self.breakdown.rollout.layout
        out = {"batch.max_tokens_per_rank": self.tokens_per_rank,
               "rollout.max_batch_size": self.breakdown.rollout_batch,
               "rollout.kv_cache_memory": int(self.breakdown.kv_cache_memory),
               "rollout.layout.tp": infer.tp, "rollout.layout.pp": infer.pp}
        if infer.ep > 1 or self.layout.ep > 1 or infer.etp or self.layout.etp:  # MoE: its expert sizes too
            out.update({"rollout.layout.ep": infer.ep, "rollout.layout.etp": infer.etp or infer.tp})
        return out

    def settings(self, with_critic: bool = True) -> dict:
        """Every config key this candidate decides: its layout's and :meth:`batch_settings`."""
        return {**self.layout.settings(with_critic), **self.batch_settings()}

    def overrides(self, with_critic: bool = True) -> list[str]:
        """:meth:`settings` as the command-line overrides to paste (dense: no expert sizes)."""
        return self.layout.overrides(with_critic) + [f"{k}={format_value(v)}" for k, v in self.batch_settings().items()]


@dataclasses.dataclass
class Plan:
    gpus: int
    gpu_memory_gib: float
    candidates: list[Candidate]
    recommended: Optional[Candidate]
    min_nodes: Optional[int] = None

    @property
    def budget_gib(self) -> float:
        """What a layout may use per GPU: :data:`HEADROOM` of its memory."""
        return HEADROOM * self.gpu_memory_gib


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in PARALLEL_SIZES if d <= limit and n % d == 0]


def cp_comm_options(cfg: ModelConfig, tp: int, cp: int, gpus_per_node: int) -> list[tuple[str, Optional[tuple]]]:
    """``(cp_comm_type, hierarchical sizes)`` to try at this TP and CP: the ring; a2a when the
    heads per TP rank split over all of CP; a2a+p2p (cp >= 4) with the largest a2a group that
    splits them and stays inside a node, the ring across the groups."""
    if cp == 1:
        return [("p2p", None)]
    out: list[tuple[str, Optional[tuple]]] = [("p2p", None)]
    if a2a_heads_ok(cfg, tp, cp):
        out.append(("a2a", None))
    inner = [a for a in PARALLEL_SIZES if 2 <= a <= cp // 2 and cp % a == 0 and tp * a <= gpus_per_node
             and a2a_heads_ok(cfg, tp, a)]
    if inner:
        out.append(("a2a+p2p", (inner[-1], cp // inner[-1])))
    return out


def layouts_for(cfg: ModelConfig, gpus: int, gpus_per_node: int, rollout_layout: Optional[dict] = None,
                generators: int = 0, in_place: bool = False):
    """Every layout to estimate; ``rollout_layout``: the sizes the config sets for megatron's
    engine (None: chosen per layout by :func:`megatron_rl.planner.memory.choose_rollout_layout`;
    ``in_place``: the training layout's, as an int8 LoRA base generates).
    ``generators``: GPUs of the ``gpus`` that only generate (``rollout.ranks``, megatron's engine
    on ``rollout.layout``); the layouts are the other GPUs'."""
    gpus -= generators
    for tp in _divisors(gpus, min(MAX_TP, gpus_per_node)):
        for pp in _divisors(gpus // tp, gpus):
            dense = PlanOption.of(tp=tp, pp=pp)
            if problems(TP_RULES + PP_RULES, cfg, dense, dense, None):  # the other rules: below
                continue
            for cp in _divisors(gpus // (tp * pp), gpus):
                dp = gpus // (tp * pp * cp)
                for (comm, levels), recompute, offload, dist_opt in itertools.product(
                        cp_comm_options(cfg, tp, cp, gpus_per_node), (None, "selective", "full"), (False, True),
                        (False, True)):
                    if dist_opt and dp * cp == 1:
                        continue
                    for ep, etp in moe.layout_options(cfg, gpus, tp, pp) if is_moe(cfg) else [(1, None)]:
                        infer = None
                        if rollout_layout or in_place:
                            infer = ParallelLayout.for_rollout(RolloutLayoutConfig(**(rollout_layout or {})),
                                                               ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp))
                        lay = PlanOption.of(tp=tp, pp=pp, cp=cp, dp=dp, recompute=recompute, offload=offload,
                                            distributed_optimizer=dist_opt, cp_comm_type=comm, hierarchical_cp=levels,
                                            ep=ep, etp=etp, rollout_layout=infer, generators=generators)
                        if not training_problems(cfg, lay, lay.world):  # what validate refuses, never proposed
                            yield lay


_RECOMPUTE_ORDER = {None: 0, "selective": 1, "full": 2}

# How fitting candidates are ranked, most important first; the first one is recommended.  Each
# rule: what it prefers (printed by ``megatron-rl plan``) and the sort key that prefers it.
RANKING: tuple[tuple[str, Callable[[Candidate], object]], ...] = (
    ("no offload", lambda c: c.layout.offload),
    ("less recompute (none, selective, full)", lambda c: _RECOMPUTE_ORDER[c.layout.recompute]),
    ("fewest GPUs per model replica (tp x pp x cp), so more data parallelism",
     lambda c: c.layout.tp * c.layout.pp * c.layout.cp),
    ("fewer pipeline stages", lambda c: c.layout.pp),
    ("the smallest expert parallelism (fewer all-to-alls)", lambda c: c.layout.ep),
    ("no distributed optimizer", lambda c: c.layout.distributed_optimizer),
    ("the CP ring (p2p, the default) before a2a and a2a+p2p", lambda c: c.layout.cp_comm_type != "p2p"),
    ("less memory", lambda c: c.breakdown.total),
)


def _cost(c: Candidate) -> tuple:
    return tuple(key(c) for _, key in RANKING)


def plan(cfg: ModelConfig, *, prompt_len: int, response_len: int, nodes: int, gpus_per_node: int,
         gpu_memory_gib: float, max_tokens_per_rank: Optional[int] = None, rollout_batch: int = 256,
         with_critic: bool = True, with_reference: bool = True, search_nodes: int = MAX_SEARCH_NODES,
         rollout_concurrency: Optional[int] = None, rollout_layout: Optional[dict] = None,
         generators: int = 0, actor_lora=None, critic_lora=None, teachers: tuple = (),
         teacher_sizes: Optional[dict] = None) -> Plan:
    """``rollout_concurrency``: the sequences per
    replica megatron's engine must hold when the plan chooses ``rollout.layout``;
    ``rollout_layout``: the sizes a config sets (any set: no choice, unset sizes the training's);
    ``generators``: GPUs that only generate (``rollout.ranks``): both sets are sized, the
    training layout over the rest, ``rollout.layout`` over them; ``actor_lora`` / ``critic_lora``
    (``LoRAConfig``): those models train LoRA adapters on a frozen base
    (:func:`megatron_rl.planner.memory.model_state`); ``teachers``: distillation teachers'
    ``ModelConfig``s, each frozen on the training layout or on ``teacher_sizes``
    (``algorithm.distill.layout``: tp / pp / cp) on its ranks; a layout the rules refuse for a
    teacher is not proposed."""
    gpus = nodes * gpus_per_node
    if not 0 <= generators < gpus:
        raise ValueError(f"{generators} generator GPUs leave no GPU to train on among {gpus}")
    seq = prompt_len + response_len
    if rollout_layout and not any(rollout_layout.values()):
        rollout_layout = None
    candidates = []
    for lay in layouts_for(cfg, gpus, gpus_per_node, rollout_layout, generators,
                           in_place=int8_base(actor_lora) and not generators):
        taught = teacher_option(lay, teacher_sizes)
        if teachers and (lay.world % (taught.tp * taught.pp * taught.cp)
                         or any(training_problems(teacher, taught, taught.world) for teacher in teachers)):
            continue
        needed = align_to(seq, alignment(lay.cp, lay.tp, lay.sequence_parallel)) // lay.cp
        tokens = max(needed, max_tokens_per_rank or 0)
        budget = HEADROOM * gpu_memory_gib * GiB
        est = estimate(cfg, lay, prompt_len=prompt_len, response_len=response_len, tokens_per_microbatch=tokens,
                       budget_bytes=budget, max_rollout_batch=rollout_batch, with_critic=with_critic,
                       with_reference=with_reference, rollout_concurrency=rollout_concurrency,
                       actor_lora=actor_lora, critic_lora=critic_lora, teachers=teachers,
                       teacher_sizes=teacher_sizes)
        candidates.append(Candidate(lay, tokens, est, est.total <= budget and est.rollout_batch >= 1))
    fitting = sorted((c for c in candidates if c.fits), key=_cost)
    result = Plan(gpus, gpu_memory_gib, sorted(candidates, key=_cost), fitting[0] if fitting else None)
    if not fitting:
        for more in range(nodes + 1, search_nodes + 1):
            bigger = plan(cfg, prompt_len=prompt_len, response_len=response_len, nodes=more,
                          gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib,
                          max_tokens_per_rank=max_tokens_per_rank, rollout_batch=rollout_batch,
                          with_critic=with_critic, with_reference=with_reference, search_nodes=0,
                          rollout_concurrency=rollout_concurrency, rollout_layout=rollout_layout,
                          generators=generators, actor_lora=actor_lora, critic_lora=critic_lora,
                          teachers=teachers, teacher_sizes=teacher_sizes)
            if bigger.recommended is not None:
                result.min_nodes = more
                break
    return result
