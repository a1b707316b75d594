"""Random parallel layouts of one model, and the model shrunk so that they run on CPU ranks.

``megatron-rl check-layouts`` and the seeded random-layout tests draw from here: a layout is
TP/PP/VPP/CP/EP/ETP/SP/cp_comm_type (DP is what the world leaves), a way of cutting the batch, full
recompute or not and the distributed optimizer or not -- kept only when ``validate`` accepts it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Optional

from megatron_rl.errors import UserInputError
from megatron_rl.testing.layout_parity import CP_LENGTHS, CP_STEP_OPTIM

# The shrunk model: a few layers (pp x vpp up to 2 x 2), a small width, heads and FFN that split 2-way.
SMALL_LAYERS = 4
SMALL_HIDDEN = 64
SMALL_FFN = 128
SMALL_VOCAB = 100
SMALL_EXPERTS = 4
FULL_RECOMPUTE = dict(granularity="full", method="uniform", num_layers=1)
# Draws tried before giving up: a feature set that admits no layout at this world size says so.
MAX_TRIES = 500


@dataclasses.dataclass(frozen=True)
class LayoutDraw:
    """One layout to compare with one process: ``use_layout`` keywords, the batch plan
    (``BatchPlan`` keywords), the model (with the drawn recompute) and the optimizer keywords."""

    layout: dict
    plan: dict
    model: object
    optim: dict

    def describe(self) -> str:
        parts = [k if v is True else f"{k}={v}" for k, v in self.layout.items()
                 if v is True or (v is not None and v is not False and v != 1)]
        if getattr(self.model, "recompute", None) is not None and self.model.recompute.granularity:
            parts.append("recompute=full")
        if self.optim.get("use_distributed_optimizer"):
            parts.append("dist-opt")
        return " ".join(parts) or "data-parallel only"

    def describe_plan(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.plan.items())


def shrink_model(model):
    """``model`` (a ModelConfig) with few layers and a small width, in fp32 with megatron's local layers;
    its kinds kept: GQA ratio (up to 4), MoE or dense (experts, top-k, shared experts, dense layers),
    norm, activation, biases, QK norm, RoPE base and scaling, tied embeddings, an explicit head dim."""
    m = copy.deepcopy(model)
    heads, groups = model.num_attention_heads, model.num_query_groups or model.num_attention_heads
    if groups == heads:
        m.num_attention_heads, m.num_query_groups = 4, None
    elif groups == 1:
        m.num_attention_heads, m.num_query_groups = min(heads, 4), 1
    else:
        m.num_query_groups = 2
        m.num_attention_heads = 2 * min(max(heads // groups, 1), 4)
    m.hf_path = None
    m.num_layers, m.hidden_size, m.ffn_hidden_size = SMALL_LAYERS, SMALL_HIDDEN, SMALL_FFN
    if model.kv_channels is not None:
        m.kv_channels = 32  # a head dim of its own (not hidden / heads), as the model has
    m.vocab_size = SMALL_VOCAB
    m.max_position_embeddings = max(model.max_position_embeddings, 2 * max(CP_LENGTHS))
    m.params_dtype, m.transformer_impl = "float32", "local"
    if m.recompute.granularity == "full":
        m.recompute.num_layers = 1
    moe = m.moe
    if moe.num_experts:
        moe.num_experts = SMALL_EXPERTS
        moe.router_topk = min(moe.router_topk, 2)
        moe.ffn_hidden_size = SMALL_FFN // 2 if moe.ffn_hidden_size else None
        moe.shared_expert_ffn_hidden_size = SMALL_FFN // 2 if moe.shared_expert_ffn_hidden_size else None
        moe.layer_freq = min(moe.layer_freq, 2)
        moe.dense_layers = [i for i in moe.dense_layers if i < SMALL_LAYERS] or ([0] if moe.dense_layers else [])
    return m


def _draw_once(rng, world: int, model) -> Optional[LayoutDraw]:
    """One candidate, or None when it does not fill ``world`` or the harness cannot run it."""
    tp, pp, cp = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2])
    if world % (tp * pp * cp):
        return None
    dp = world // (tp * pp * cp)
    layout = dict(tp=tp, pp=pp, cp=cp, sp=tp > 1 and rng.random() < 0.5)
    if cp > 1:
        layout["cp_comm_type"] = rng.choice(["p2p", "all_gather"] + (["a2a"] if tp == 1 else []))
    if pp > 1 and dp == 1 and rng.random() < 0.5:
        layout["vpp"] = 2  # 2*pp micro-batches per pass: every data-parallel rank needs 4 sequences
    if model.moe.num_experts:
        layout["ep"] = rng.choice([1, 2])
        layout["etp"] = rng.choice([None, 1, tp])
    plan = rng.choice([dict(max_tokens_per_rank=rng.choice([40, 64, 400])),
                       dict(micro_batch_size=rng.choice([1, 2, 3])),
                       dict(max_tokens_per_rank=1216, derived=True, min_microbatches=pp)])
    plan["packed"] = rng.random() < 0.75
    if not plan["packed"] and layout.get("cp_comm_type") == "a2a":
        return None
    drawn = copy.deepcopy(model)
    if rng.random() < 0.3 and not drawn.recompute.granularity:
        drawn.recompute = type(drawn.recompute)(**FULL_RECOMPUTE)
    optim = dict(CP_STEP_OPTIM, use_distributed_optimizer=dp > 1 and rng.random() < 0.5)
    return LayoutDraw(layout, plan, drawn, optim)


def draw_layout(rng, world: int, model, accept: Callable[[LayoutDraw], bool] = lambda d: True) -> LayoutDraw:
    """A random layout of ``model`` for ``world`` ranks that ``accept`` (see :func:`validated_by`) takes."""
    for _ in range(MAX_TRIES):
        draw = _draw_once(rng, world, model)
        if draw is not None and accept(draw):
            return draw
    last = getattr(accept, "last_refusal", None)
    raise UserInputError("--world", world, f"no valid layout of this model was found in {MAX_TRIES} draws"
                         + (f" (the last refused: {last})" if last else ""),
                         "use a world size the model's heads, layers and experts divide, e.g. --world 4")


def layout_config(cfg, draw: LayoutDraw, world: int):
    """``cfg`` with the drawn model, layout and optimizer: what ``validate`` judges."""
    from megatron_rl.config.schema import ParallelConfig

    out = copy.deepcopy(cfg)
    out.model = draw.model
    lay = draw.layout
    out.parallel = ParallelConfig(tp=lay["tp"], pp=lay["pp"], vpp=lay.get("vpp"), cp=lay["cp"],
                                  sequence_parallel=lay["sp"], cp_comm_type=lay.get("cp_comm_type", "p2p"),
                                  ep=lay.get("ep", 1), etp=lay.get("etp"))
    out.rollout.ranks = 0
    out.distributed.nproc = world
    for part in (out.actor, out.critic):
        part.optim.use_distributed_optimizer = draw.optim["use_distributed_optimizer"]
    return out


def validated_by(cfg, world: int) -> Callable[[LayoutDraw], bool]:
    """``accept`` for :func:`draw_layout`: the layout is one ``validate`` passes for ``cfg`` on ``world`` ranks."""
    from megatron_rl.validation import validate

    def accept(draw: LayoutDraw) -> bool:
        try:
            validate(layout_config(cfg, draw, world), world, generates=False)
        except UserInputError as err:
            accept.last_refusal = err.one_line()
            return False
        return True

    return accept
