"""``megatron-rl plan``: which layout fits a PPO job, per GPU and by component.

    megatron-rl plan --model qwen2.5-7b --prompt-len 1024 --response-len 32768 \\
        --nodes 1 --gpus-per-node 8 --gpu-memory 80

``--model`` is a preset name (``megatron-rl plan --list-models``) or a local HF model directory.
Prints per-GPU memory of candidate layouts (weights, grads and optimizer states of actor, critic
and reference; activations with and without recompute; the log-prob path; the rollout's weights
and KV cache on megatron's engine's layout), marks which fit, recommends one with the overrides to paste,
and when nothing fits
names the smallest node count that does.  Each row shows its CP communication, the training peak,
the total and what is left of the budget; the ranking rule that orders the rows is printed with
them.  ``--config`` takes the lengths and models from a recipe and lists the keys where it differs
from the recommendation.  ``--lora-rank`` (or a recipe's ``actor.lora`` / ``critic.lora``) plans
LoRA: a frozen base without grads or optimizer state, fp32 adapters with their grads and Adam
(printed on lines of their own), and no reference copy.  ``--teacher`` (or a recipe's
``algorithm.distill.teachers``) adds each distillation teacher: its frozen weights on the training
layout or on ``--teacher-tp/-pp/-cp`` (``algorithm.distill.layout``), and the peak of its
forward-only scoring pass.
"""

from __future__ import annotations

import argparse
import os
import textwrap

from megatron_rl.config.choices import LORA_BASE_QUANTIZATIONS
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.errors import ConfigError
from megatron_rl.layout.lora import ALL_LINEAR, PROJECTIONS, adapter_params, int8_base, unknown_targets
from megatron_rl.planner.memory import ROLLOUT_CONCURRENCY, teacher_name, total_params
from megatron_rl.planner.option import format_value
from megatron_rl.planner.recipe import PlanInputs, differences, plan_inputs
from megatron_rl.planner.search import HEADROOM, HEADROOM_NOTE, PRESETS, RANKING, Candidate, Plan, plan, preset


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset name or local HF model directory")
    p.add_argument("--config", help="a recipe: plan for its prompt and response lengths, critic and reference, "
                                    "and list the keys where it differs from the recommendation")
    p.add_argument("--prompt-len", type=int, help="default 1024, or the recipe's data.max_prompt_tokens")
    p.add_argument("--response-len", type=int, help="default 8192, or the recipe's rollout.max_new_tokens")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--max-tokens-per-rank", type=int, help="token budget per micro-batch (default: one sequence)")
    p.add_argument("--rollout-batch", type=int, default=256, help="most sequences to generate together (KV cache)")
    p.add_argument("--rollout-concurrency", type=int,
                   help="megatron's engine: sequences each inference replica must hold when the plan chooses "
                        f"rollout.layout (default {ROLLOUT_CONCURRENCY}, or the recipe's rollout.max_batch_size)")
    p.add_argument("--generator-gpus", type=int,
                   help="GPUs that only generate (rollout.ranks; default 0, or the recipe's): the training layout "
                        "is planned over the others and rollout.layout over these")
    p.add_argument("--no-critic", action="store_true", help="GRPO/RLOO: no critic")
    p.add_argument("--no-reference", action="store_true", help="no KL: no reference model")
    p.add_argument("--lora-rank", type=int,
                   help="actor LoRA rank (actor.lora.rank; default 0 = full fine-tuning, or the recipe's): a frozen "
                        "base without grads or optimizer state, fp32 adapters with their grads and Adam, and no "
                        "reference copy (the reference is the base, adapters off)")
    p.add_argument("--lora-targets", default=ALL_LINEAR,
                   help="with --lora-rank: the projections with adapters, comma-separated HF names "
                        f"(actor.lora.target_modules; default {ALL_LINEAR})")
    p.add_argument("--lora-quantize-base", choices=LORA_BASE_QUANTIZATIONS, default="none",
                   help="with --lora-rank: the frozen base's projections in int8, a byte per weight "
                        "(actor.lora.quantize_base; default none: the model's dtype)")
    p.add_argument("--teacher", action="append", default=[],
                   help="an on-policy distillation teacher (preset or local HF model directory; repeat for several): "
                        "frozen bf16 weights on the training layout and its scoring pass (default: the recipe's "
                        "algorithm.distill.teachers)")
    for name, what in (("tp", "tensor-parallel size"), ("pp", "pipeline stages"), ("cp", "context-parallel size")):
        p.add_argument(f"--teacher-{name}", type=int,
                       help=f"the teachers' own {what} (algorithm.distill.layout.{name}; default: the training "
                            "layout's, or the recipe's)")
    p.add_argument("--show", type=int, default=12, help="candidate layouts to print")
    p.add_argument("--list-models", action="store_true")


def _model(spec: str, key: str = "--model"):
    if spec in PRESETS:
        return preset(spec)
    if spec and os.path.isdir(spec):
        from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

        return model_config_from_hf(read_hf_config(spec))
    raise ConfigError(key, spec, "neither a preset nor a directory",
                      f"use one of {', '.join(PRESETS)} or a local HF model directory")


def _teacher_sizes(args, recipe: dict | None) -> dict | None:
    """``--teacher-tp`` / ``--teacher-pp`` / ``--teacher-cp`` over the recipe's algorithm.distill.layout."""
    sizes = dict(recipe or {})
    for name in ("tp", "pp", "cp"):
        given = getattr(args, f"teacher_{name}")
        if given is not None:
            if given < 1:
                raise ConfigError(f"--teacher-{name}", given, "must be >= 1", "give a positive size")
            sizes[name] = given
    return sizes or None


def _teachers(args, cfg) -> tuple:
    """``--teacher`` (each a preset or a directory), else the recipe's ``algorithm.distill.teachers``
    read from their directories (a directory this machine lacks: name a preset with --teacher)."""
    if args.teacher:
        return tuple(_model(spec, "--teacher") for spec in args.teacher)
    if cfg is None or not cfg.algorithm.distill.teachers:
        return ()
    from megatron_rl.engine.teachers import read_teachers

    try:
        return tuple(t.model for t in read_teachers(cfg.algorithm.distill.teachers, cfg.model))
    except ConfigError as err:
        fix = "plan for it with --teacher PRESET (megatron-rl plan --list-models) or --teacher DIR"
        raise ConfigError(err.key, err.value, err.problem, fix) from None


# The table's columns: header, right-aligned.
COLUMNS = (("layout", False), ("cp-comm", False), ("options", False), ("tok/rank", True), ("weights", True),
           ("grads", True), ("optim", True), ("acts", True), ("logprob", True), ("rollout", True), ("gen", True),
           ("infer", False), ("i-wts", True), ("kv", True), ("roll", True), ("train", True), ("total", True),
           ("free", True), ("fits", False))


def layout_name(c: Candidate) -> str:
    lay = c.layout
    name = f"tp{lay.tp} pp{lay.pp} cp{lay.cp} dp{lay.dp}"
    if lay.ep > 1 or (lay.etp or lay.tp) != lay.tp:  # MoE
        name += f" ep{lay.ep}" + (f" etp{lay.etp}" if (lay.etp or lay.tp) != lay.tp else "")
    return name


def cp_comm(c: Candidate) -> str:
    """The CP communication: ``-`` without CP, a2a+p2p with its (a2a x ring) sizes."""
    lay = c.layout
    if lay.cp == 1:
        return "-"
    if lay.cp_comm_type == "a2a+p2p":
        return "a2a+p2p({}x{})".format(*lay.settings()["parallel.hierarchical_context_parallel_sizes"])
    return lay.cp_comm_type


def _options(c: Candidate) -> str:
    """The memory switches that are on, ``-`` for none."""
    lay = c.layout
    return ",".join(f for f, on in (("sp", lay.sequence_parallel and lay.tp > 1),
                                    (f"rc-{lay.recompute}", bool(lay.recompute)), ("offload", lay.offload),
                                    ("distopt", lay.distributed_optimizer)) if on) or "-"


def infer_name(c: Candidate) -> str:
    """megatron's engine: the inference layout and its replicas (``tp1 pp1 x8``)."""
    mem = c.breakdown.rollout
    return f"{mem.layout.name()} x{mem.replicas}"


def row_cells(c: Candidate, budget_gib: float) -> list[str]:
    parts = c.breakdown.gib()
    weights = sum(v for k, v in parts.items() if k.endswith("weights"))
    grads = sum(v for k, v in parts.items() if k.endswith("grads"))
    optim = sum(v for k, v in parts.items() if k.endswith("optimizer"))
    gib = (weights, grads, optim, parts["activations"], parts["log-prob path"], parts["rollout (weights + KV cache)"])
    return ([layout_name(c), cp_comm(c), _options(c), str(c.tokens_per_rank)] + [f"{v:.1f}" for v in gib]
            + [str(c.breakdown.rollout_batch), infer_name(c),
               f"{c.breakdown.rollout.extra_weights / 2**30:.1f}",
               f"{c.breakdown.rollout_kv / 2**30:.1f}", f"{c.breakdown.rollout_peak / 2**30:.1f}",
               f"{c.breakdown.train_peak / 2**30:.1f}", f"{c.total_gib:.1f}",
               f"{budget_gib - c.total_gib:.1f}", "yes" if c.fits else "no"])


def format_table(rows: list[list[str]]) -> list[str]:
    """Header and rows, each column as wide as its widest cell, two spaces apart."""
    cells = [[name for name, _ in COLUMNS]] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return ["  " + "  ".join(cell.rjust(w) if right else cell.ljust(w)
                             for cell, w, (_, right) in zip(r, widths, COLUMNS)).rstrip() for r in cells]


def ranking_lines(width: int = 110) -> list[str]:
    """The rule that orders the rows, from :data:`megatron_rl.planner.search.RANKING`."""
    rules = "; ".join(f"{i}) {text}" for i, (text, _) in enumerate(RANKING, 1))
    return textwrap.wrap(f"ranking: rows that fit first, each group ordered by {rules}. The first row that fits "
                         "is recommended.", width, subsequent_indent="  ", break_on_hyphens=False)


def _inputs(args) -> PlanInputs:
    """The recipe's lengths and models under --config; flags given on the command line win."""
    base, cfg = PlanInputs(1024, 8192, True, True), None
    if args.config:
        from megatron_rl.config.loader import load_config

        cfg = load_config(args.config)
        base = plan_inputs(cfg)
    generators = base.generators if args.generator_gpus is None else args.generator_gpus
    teachers, teacher_sizes = _teachers(args, cfg), _teacher_sizes(args, base.teacher_sizes)
    given = next((f"--teacher-{k}" for k in ("tp", "pp", "cp") if getattr(args, f"teacher_{k}") is not None), None)
    if given and not teachers:
        raise ConfigError(given, getattr(args, given[2:].replace("-", "_")), "places a teacher, but there is none",
                          "name the teacher with --teacher PRESET|DIR (or a recipe's algorithm.distill.teachers)")
    return PlanInputs(args.prompt_len or base.prompt_len, args.response_len or base.response_len,
                      base.with_critic and not args.no_critic, base.with_reference and not args.no_reference,
                      args.rollout_concurrency or base.rollout_concurrency, base.rollout_layout, generators,
                      _actor_lora(args, base.actor_lora), base.critic_lora, teachers, teacher_sizes)


def _actor_lora(args, recipe: LoRAConfig | None) -> LoRAConfig | None:
    """``--lora-rank`` / ``--lora-targets`` (alpha does not change memory), else the recipe's actor.lora."""
    if args.lora_rank is None:
        if args.lora_quantize_base != "none":
            raise ConfigError("--lora-quantize-base", args.lora_quantize_base, "given without --lora-rank",
                              "add --lora-rank R (or set actor.lora.quantize_base in the recipe)")
        return recipe
    if args.lora_rank < 0:
        raise ConfigError("--lora-rank", args.lora_rank, "negative", "give 0 (full fine-tuning) or a positive rank")
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    bad = unknown_targets(targets)
    if bad or not targets:
        raise ConfigError("--lora-targets", args.lora_targets, f"unknown projection(s) {', '.join(bad) or '(none)'}",
                          f"comma-separated {', '.join(PROJECTIONS)} or {ALL_LINEAR}")
    if not args.lora_rank:
        if args.lora_quantize_base != "none":
            raise ConfigError("--lora-quantize-base", args.lora_quantize_base,
                              "quantizes a LoRA base; --lora-rank is 0", "give a positive --lora-rank, or drop it")
        return None
    return LoRAConfig(rank=args.lora_rank, target_modules=targets, quantize_base=args.lora_quantize_base)


def _models_line(inputs: PlanInputs) -> str:
    """The models the plan holds; with LoRA, what each LoRA model keeps."""
    def lora(name: str, cfg: LoRAConfig | None) -> str:
        if cfg is None:
            return name
        base = "int8" if int8_base(cfg) else "bf16"
        return (f"{name} with LoRA rank {cfg.rank} on {','.join(cfg.target_modules)} (frozen {base} base, fp32 "
                "adapters + grads + Adam)")

    reference = ""
    if inputs.with_reference:
        reference = ", reference = the actor's base with adapters off (no copy)" if inputs.actor_lora else ", reference"
    teachers = ""
    if inputs.teachers:
        teachers = ", " + ", ".join(f"{teacher_name(i, len(inputs.teachers))} ({total_params(t) / 1e9:.1f}B, frozen)"
                                    for i, t in enumerate(inputs.teachers))
    return lora("actor", inputs.actor_lora) + (", " + lora("critic", inputs.critic_lora) if inputs.with_critic
                                               else "") + reference + teachers


def lora_lines(cfg, best: Candidate, inputs: PlanInputs) -> list[str]:
    """With LoRA, the model-state lines of ``best`` per GPU: each model's frozen base and its
    adapters' weights, grads and optimizer state."""
    lines = []
    for name, lora in (("actor", inputs.actor_lora), ("critic", inputs.critic_lora if inputs.with_critic else None)):
        if lora is None:
            continue
        lay, parts = best.layout, best.breakdown.components
        count = adapter_params(cfg, lora, lay.tp) / lay.pp
        lines.append(f"{name} LoRA: {count / 1e6:.2f}M adapter parameters per GPU; base weights "
                     f"{_amount(parts[name + ' weights'])} (frozen: no grads, no optimizer state), LoRA weights "
                     f"{_amount(parts[name + ' LoRA weights'])}, LoRA grads {_amount(parts[name + ' LoRA grads'])}, "
                     f"LoRA optimizer {_amount(parts[name + ' LoRA optimizer'])}")
    return lines


def teacher_lines(best: Candidate, inputs: PlanInputs) -> list[str]:
    """With distillation, each teacher's weights per GPU and the peak of the scoring phase."""
    if not inputs.teachers:
        return []
    from megatron_rl.planner.memory import teacher_option

    b = best.breakdown
    names = [teacher_name(i, len(inputs.teachers)) for i in range(len(inputs.teachers))]
    weights = ", ".join(f"{n} weights {_amount(b.components[n + ' weights'])}" for n in names)
    where = "its own weights alone resident (trainer.offload)" if best.layout.offload else "every model resident"
    taught = teacher_option(best.layout, inputs.teacher_sizes)
    on = "the training layout" if taught is best.layout else f"its own layout tp{taught.tp} pp{taught.pp} cp{taught.cp}"
    return [f"distillation: {weights} per GPU on {on} (frozen bf16, no grads or optimizer state); scoring peak "
            f"{_amount(b.teacher_peak)} ({where}, one forward of {best.tokens_per_rank} tokens per training rank)"]


def _amount(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _print_table(args, result: Plan, inputs: PlanInputs) -> None:
    print(f"per-GPU memory in GiB (bf16 weights, fp32 grads, fp32 Adam + master weights; {_models_line(inputs)})")
    budget = (f"budget: {result.budget_gib:.1f} GiB per GPU, {HEADROOM:.0%} of {args.gpu_memory:g} ({HEADROOM_NOTE}). "
              "Generation's KV cache takes what the models leave, up to --rollout-batch sequences (gen), so totals "
              "sit near the budget; train is the training peak, free = budget - total. megatron's engine generates "
              "on rollout.layout (infer: its TP/PP and replicas; i-wts: the second copy of its weights, 0 when it "
              "shares the actor's, freed after each rollout); kv: the KV cache per rank; roll: the rollout phase's "
              "peak (the training state left resident, generation's weights and KV). With --generator-gpus the "
              "layouts are the training GPUs' (total: their training peak) and gen, infer, i-wts, kv and roll the "
              "generator GPUs'.")
    for line in textwrap.wrap(budget, 110, subsequent_indent="  ", break_on_hyphens=False) + ranking_lines():
        print(line)
    shown = [c for c in result.candidates if c.fits][: args.show]
    shown += [c for c in result.candidates if not c.fits][: max(0, args.show - len(shown))]
    for line in format_table([row_cells(c, result.budget_gib) for c in shown]):
        print(line)


def _recommendation(result: Plan, inputs: PlanInputs) -> list[str]:
    best = result.recommended
    b = best.breakdown
    lines = [f"recommended: {layout_name(best)}, cp-comm {cp_comm(best)}, options {_options(best)}: "
             f"{best.total_gib:.1f} of {result.budget_gib:.1f} GiB ({result.budget_gib - best.total_gib:.1f} free; "
             f"training peak {b.train_peak / 2**30:.1f}), {b.rollout_batch} sequences generated together"]
    lines.append(f"rollout.layout: {b.rollout_why}")
    if best.layout.generators:
        g = b.rollout
        lines.append(f"generator GPUs: {best.layout.generators}, each {g.peak / 2**30:.1f} of {result.budget_gib:.1f} "
                     f"GiB (weights {g.weights / 2**30:.1f}, KV cache {g.kv / 2**30:.1f} for {g.sequences} "
                     f"sequences per replica, {g.concurrency} at once); training GPUs: "
                     f"{result.gpus - best.layout.generators}, each {b.train_peak / 2**30:.1f} GiB")
    return lines + ["overrides:   " + " ".join(best.overrides(inputs.with_critic))]


def _compare(path: str, best: Candidate, inputs: PlanInputs) -> int:
    from megatron_rl.config.loader import load_config

    diffs = differences(load_config(path), best.settings(inputs.with_critic))
    if not diffs:
        print(f"{path}: every planned key agrees with the recommendation")
        return 0
    print(f"{path} differs from the recommendation:")
    for key, have, planned in diffs:
        print(f"  {key}: {format_value(have)} (plan: {format_value(planned)})")
    return 1


def run_plan(args) -> int:
    if args.list_models:
        for name in PRESETS:
            print(f"{name:<14} {total_params(preset(name)) / 1e9:.1f}B parameters")
        return 0
    if not args.model:
        raise ConfigError("--model", None, "missing", "give a preset (--list-models) or an HF model directory")
    cfg = _model(args.model)
    inputs = _inputs(args)
    result = plan(cfg, prompt_len=inputs.prompt_len, response_len=inputs.response_len, nodes=args.nodes,
                  gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory,
                  max_tokens_per_rank=args.max_tokens_per_rank, rollout_batch=args.rollout_batch,
                  with_critic=inputs.with_critic, with_reference=inputs.with_reference,
                  rollout_concurrency=inputs.rollout_concurrency, rollout_layout=inputs.rollout_layout,
                  generators=inputs.generators, actor_lora=inputs.actor_lora, critic_lora=inputs.critic_lora,
                  teachers=inputs.teachers, teacher_sizes=inputs.teacher_sizes)
    print(f"model {args.model}: {total_params(cfg) / 1e9:.2f}B parameters; sequence {inputs.prompt_len} + "
          f"{inputs.response_len} tokens; {args.nodes} node(s) x {args.gpus_per_node} GPUs x {args.gpu_memory:g} GiB")
    _print_table(args, result, inputs)
    if result.recommended is None:
        where = (f"the smallest cluster that fits is {result.min_nodes} node(s) of {args.gpus_per_node} GPUs"
                 if result.min_nodes else "no cluster up to 64 nodes fits: shorten the sequence or use bigger GPUs")
        print(f"\nnot possible on {args.nodes} node(s): {where}")
        return 1
    print()
    for line in (_recommendation(result, inputs) + lora_lines(cfg, result.recommended, inputs)
                 + teacher_lines(result.recommended, inputs)):
        print(line)
    return _compare(args.config, result.recommended, inputs) if args.config else 0
