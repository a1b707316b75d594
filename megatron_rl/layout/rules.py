"""What a layout must satisfy, written once: the training layout's divisibility, head, FFN, vocab
and expert rules, and ``rollout.layout``'s.  The feature registry turns each rule into a check
before launch (with its one-line refusal), and the planner proposes only layouts every rule
allows, so ``megatron-rl plan`` never suggests what ``megatron-rl validate`` refuses.

A rule's ``holds(model, layout, train, world)`` reads the model config, the layout it is about (the
training sizes: a ``parallel`` config or the planner's ``PlanOption``; or the rollout's
:meth:`~megatron_rl.layout.sizes.ParallelLayout.for_rollout`), the training layout (the same
object for the training rules) and the ranks it spans (None when unknown: the rules on the world
size hold).
``problem`` and ``fix`` are templates over the config ``c`` and world ``w``; ``text`` is the rule
as the feature matrix lists it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from megatron_rl.config.schema import ModelConfig
from megatron_rl.layout.arch import attention_dims, expert_ffn_size, is_moe, padded_vocab_size
from megatron_rl.layout.sizes import expert_tp, shares_training_weights


def _always(model, layout) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class LayoutRule:
    key: str
    holds: Callable[[ModelConfig, object, object, Optional[int]], bool]
    problem: str
    fix: str
    text: str
    applies: Callable[[ModelConfig, object], bool] = _always  # (model, layout): False = the rule says nothing

    def broken_by(self, model: ModelConfig, layout, train, world: Optional[int]) -> bool:
        return self.applies(model, layout) and not self.holds(model, layout, train, world)


def problems(rules, model: ModelConfig, layout, train, world: Optional[int]) -> list[LayoutRule]:
    """The ``rules`` that ``layout`` breaks for this model and world (empty: it is allowed)."""
    return [rule for rule in rules if rule.broken_by(model, layout, train, world)]


def _moe(model, layout) -> bool:
    return is_moe(model)


def _vpp(model, layout) -> bool:
    return (getattr(layout, "vpp", None) or 1) > 1


def a2a_heads_ok(model: ModelConfig, tp: int, a2a: int) -> bool:
    """Whether a2a over ``a2a`` ranks can split this model's heads at ``tp``: query heads per TP
    rank divisible by it, K/V heads divisible by it (split) or dividing it (replicated)."""
    nq, nkv, _ = attention_dims(model)
    q_local, kv_local = nq // tp, max(nkv // tp, 1)
    return q_local % a2a == 0 and (kv_local % a2a == 0 or a2a % kv_local == 0)


# ----------------------------------------------------------------------------- the training layout
TP_RULES = (
    LayoutRule("parallel.tp", lambda m, lay, train, w: attention_dims(m)[0] % lay.tp == 0,
               "model.num_attention_heads={c.model.num_attention_heads} is not divisible by tp",
               "use a tp that divides the number of attention heads", "num_attention_heads % tp == 0"),
    LayoutRule("parallel.tp", lambda m, lay, train, w: attention_dims(m)[1] % lay.tp == 0,
               "KV heads (model.num_query_groups={c.model.num_query_groups}) are not divisible by tp",
               "use a tp that divides the number of KV heads", "num_query_groups % tp == 0"),
    LayoutRule("parallel.tp", lambda m, lay, train, w: m.ffn_hidden_size % lay.tp == 0,
               "model.ffn_hidden_size={c.model.ffn_hidden_size} is not divisible by tp",
               "use a tp that divides ffn_hidden_size", "ffn_hidden_size % tp == 0"),
)
PP_RULES = (
    LayoutRule("parallel.pp", lambda m, lay, train, w: m.num_layers % lay.pp == 0,
               "model.num_layers={c.model.num_layers} is not divisible by pp",
               "use a pp that divides the number of layers", "num_layers % pp == 0"),
)
VPP_RULES = (
    LayoutRule("parallel.vpp", lambda m, lay, train, w: lay.pp > 1,
               "virtual pipeline stages need pipeline parallelism", "set parallel.pp>=2 or parallel.vpp=null",
               "pp >= 2", applies=_vpp),
    LayoutRule("parallel.vpp", lambda m, lay, train, w: m.num_layers % (lay.pp * lay.vpp) == 0,
               "model.num_layers={c.model.num_layers} is not divisible by pp*vpp",
               "choose pp*vpp that divides the number of layers", "num_layers % (pp*vpp) == 0", applies=_vpp),
)
EP_RULES = (
    LayoutRule("parallel.ep", lambda m, lay, train, w: is_moe(m), "expert parallelism needs an MoE model",
               "set model.moe.num_experts (or model.hf_path to an MoE checkpoint), or parallel.ep=1",
               "ep > 1 needs model.moe.num_experts", applies=lambda m, lay: lay.ep > 1),
    LayoutRule("parallel.ep", lambda m, lay, train, w: m.moe.num_experts % lay.ep == 0,
               "model.moe.num_experts={c.model.moe.num_experts} is not divisible by ep",
               "choose an ep that divides the number of experts", "num_experts % ep == 0", applies=_moe),
    LayoutRule("parallel.ep", lambda m, lay, train, w: w is None or w % (expert_tp(lay) * lay.ep * lay.pp) == 0,
               "world size {w} is not divisible by etp*ep*pp (one copy of the experts spans etp x ep x pp ranks)",
               "choose etp*ep*pp that divides {w}, e.g. ep = {w} / (etp*pp)", "world size divisible by etp*ep*pp"),
)
ETP_RULES = (
    LayoutRule("parallel.etp", lambda m, lay, train, w: is_moe(m), "expert tensor parallelism needs an MoE model",
               "set model.moe.num_experts, or parallel.etp=null", "etp needs model.moe.num_experts",
               applies=lambda m, lay: lay.etp is not None and lay.etp != lay.tp),
    LayoutRule("parallel.etp", lambda m, lay, train, w: expert_ffn_size(m) % expert_tp(lay) == 0,
               "an expert's hidden units ({c.model.moe.ffn_hidden_size}) are not divisible by etp (null = tp)",
               "choose an etp that divides model.moe.ffn_hidden_size", "moe.ffn_hidden_size % etp == 0",
               applies=_moe),
    LayoutRule("parallel.etp", lambda m, lay, train, w: not m.add_bias_linear or expert_tp(lay) == 1,
               "megatron-core supports MoE linear biases only with etp=1", "set parallel.etp=1",
               "linear biases need etp=1", applies=_moe),
)
TRAINING_RULES = TP_RULES + PP_RULES + VPP_RULES + EP_RULES + ETP_RULES


def training_problems(model: ModelConfig, layout, world: Optional[int]) -> list[LayoutRule]:
    """The rules the training ``layout`` (``parallel`` config or ``PlanOption``) breaks on ``world`` ranks."""
    return problems(TRAINING_RULES, model, layout, layout, world)


# ----------------------------------------------------------------------------- rollout.layout
def _padded_rows_split(m, lay, train, w) -> bool:
    return padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, train.tp) % lay.tp == 0


ROLLOUT_RULES = (
    LayoutRule(
        "rollout.layout.tp", lambda m, lay, train, w: w is None or w % (lay.tp * lay.pp) == 0,
        "rollout.layout tp*pp={c.rollout.layout.tp}x{c.rollout.layout.pp} does not divide the world size {w}",
        "choose rollout.layout.tp and .pp whose product divides {w}", "world size divisible by rollout tp*pp"),
    LayoutRule(
        "rollout.layout.ep", lambda m, lay, train, w: w is None or w % (lay.expert_tp * lay.ep * lay.pp) == 0,
        "rollout.layout etp*ep*pp does not divide the world size {w} (null etp = rollout.layout.tp)",
        "choose rollout.layout.etp, .ep and .pp whose product divides {w}",
        "world size divisible by rollout etp*ep*pp"),
    LayoutRule(
        "rollout.layout.tp", lambda m, lay, train, w: attention_dims(m)[0] % lay.tp == 0,
        "model.num_attention_heads={c.model.num_attention_heads} is not divisible by rollout.layout.tp",
        "use a rollout.layout.tp that divides the number of attention heads", "num_attention_heads % rollout tp == 0"),
    LayoutRule(
        "rollout.layout.tp", lambda m, lay, train, w: attention_dims(m)[1] % lay.tp == 0,
        "KV heads (model.num_query_groups={c.model.num_query_groups}) are not divisible by rollout.layout.tp",
        "use a rollout.layout.tp that divides the number of KV heads", "num_query_groups % rollout tp == 0"),
    LayoutRule(
        "rollout.layout.tp", lambda m, lay, train, w: m.ffn_hidden_size % lay.tp == 0,
        "model.ffn_hidden_size={c.model.ffn_hidden_size} is not divisible by rollout.layout.tp",
        "use a rollout.layout.tp that divides model.ffn_hidden_size", "ffn_hidden_size % rollout tp == 0"),
    LayoutRule(
        "rollout.layout.tp", _padded_rows_split,
        "rollout.layout.tp does not divide the training model's padded vocabulary rows (parallel.tp={c.parallel.tp})",
        "use a rollout.layout.tp that divides parallel.tp x model.make_vocab_size_divisible_by",
        "padded vocabulary rows % rollout tp == 0"),
    LayoutRule(
        "rollout.layout.pp", lambda m, lay, train, w: m.num_layers % lay.pp == 0,
        "model.num_layers={c.model.num_layers} is not divisible by rollout.layout.pp",
        "use a rollout.layout.pp that divides the number of layers", "num_layers % rollout pp == 0"),
    LayoutRule(
        "rollout.layout.ep", lambda m, lay, train, w: (m.moe.num_experts % lay.ep == 0) if is_moe(m) else lay.ep == 1,
        "rollout.layout.ep must divide the experts of an MoE model",
        "use a rollout.layout.ep that divides model.moe.num_experts (1 for a dense model)",
        "num_experts % rollout ep == 0"),
    LayoutRule(
        "rollout.layout.etp", lambda m, lay, train, w: expert_ffn_size(m) % lay.expert_tp == 0,
        "an expert's hidden units (model.moe.ffn_hidden_size={c.model.moe.ffn_hidden_size}) are not divisible by "
        "rollout.layout.etp (null = rollout.layout.tp)",
        "choose a rollout.layout.etp that divides model.moe.ffn_hidden_size", "moe.ffn_hidden_size % rollout etp == 0",
        applies=_moe),
    LayoutRule(
        "rollout.layout.ep",
        lambda m, lay, train, w: lay.ep == 1 or lay.pp == 1 or shares_training_weights(lay, train),
        "megatron's engine generates on a model of its own with rollout.layout.ep > 1 only when "
        "rollout.layout.pp is 1 (the training layout's own PP x EP shards generate in place)",
        "set rollout.layout.pp=1 (more replicas), rollout.layout.ep=1, or leave rollout.layout unset",
        "a model of its own: rollout ep > 1 only with rollout pp = 1",
        applies=_moe),
)


def rollout_problems(model: ModelConfig, infer, train, world: Optional[int]) -> list[LayoutRule]:
    """The rules ``infer`` (a rollout ``ParallelLayout``, its sizes filled) breaks beside the
    training layout ``train`` on the ``world`` ranks that generate (empty: it can generate)."""
    return problems(ROLLOUT_RULES, model, infer, train, world)
