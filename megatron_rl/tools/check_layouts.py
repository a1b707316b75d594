"""``megatron-rl check-layouts``: train a shrunk copy of the user's model on random layouts and
compare each with one process.

Parallelism composition bugs are silent: a layout that trains is not a layout that trains right.
This runs a few training steps of the config's model (shrunk, its kinds kept) on N layouts that
``validate`` accepts, on CPU gloo ranks, and prints, per layout, the largest difference from one
process of the loss, log-probs, gradient norm and updated weights.  Exit 0 when every layout is
within the tolerance, 1 when one is not (or fails), 2 for bad input.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional

from megatron_rl.errors import UserInputError
from megatron_rl.testing.layout_parity import (
    CP_LENGTHS,
    CP_TOL,
    actor_critic_step,
    max_diff_outputs,
    max_diff_tensors,
)
from megatron_rl.tools.layout_draw import LayoutDraw, draw_layout, shrink_model, validated_by

# The reference plan of the one-process run (any plan gives one process's numbers).
REFERENCE_PLAN = dict(micro_batch_size=3)
COLUMNS = ("loss", "logprob", "entropy/value", "grads", "grad-norm", "weights")


@dataclasses.dataclass
class LayoutResult:
    """Per quantity the largest |layout - one process| relative to one process's magnitude
    (:func:`relative`; None where not compared), or the error the layout raised."""

    draw: LayoutDraw
    diffs: dict
    tol: float = CP_TOL
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(v <= self.tol for v in self.diffs.values() if v is not None)


def reference_run(draw: LayoutDraw, steps: int, lengths=CP_LENGTHS) -> dict:
    """The one-process run of ``draw``'s model and optimizer (its layout aside): what layouts must give."""
    from megatron_rl.testing.harness import run_distributed

    return run_distributed(1, actor_critic_step, {}, None, tuple(lengths), REFERENCE_PLAN, False, draw.model,
                           draw.optim, True, steps)[0]


def _largest(tensors) -> float:
    return max(float(t.abs().max()) for t in tensors if t.numel())


def relative(diff: float, reference: float) -> float:
    """``diff`` over the one-process magnitude, at least 1: fp32 rounds relative to the size of a
    number, and a second step's values and gradient norm are larger than the first's."""
    return diff / max(1.0, abs(reference))


def compare_layout(world: int, draw: LayoutDraw, reference: dict, lengths=CP_LENGTHS) -> tuple[LayoutResult, dict]:
    """Run ``draw`` on ``world`` gloo ranks for as many steps as ``reference`` took; per quantity the
    largest |difference| relative to one process's magnitude (:func:`relative`), and rank 0's result.
    The distributed optimizer leaves each rank's gradient buffer reduced on its own shard only, so
    its gradients are not compared (its updated weights are)."""
    from megatron_rl.testing.harness import run_distributed

    steps = len(reference["steps"])
    got = run_distributed(world, actor_critic_step, draw.layout, reference["weights"], tuple(lengths), draw.plan,
                          False, draw.model, draw.optim, True, steps)[0]
    pairs = list(zip(got["steps"], reference["steps"], strict=True))

    def outputs(names) -> float:
        return max(relative(max_diff_outputs(a["outs"], b["outs"])[n], _largest(o[n] for o in b["outs"]))
                   for a, b in pairs for n in names)

    diffs = {
        "loss": max(relative(abs(a["loss"] - b["loss"]), b["loss"]) for a, b in pairs),
        "logprob": outputs(("logprob",)),
        "entropy/value": outputs(("entropy", "value")),
        "grads": (None if draw.optim.get("use_distributed_optimizer") else relative(
            max_diff_tensors(got["grads"], reference["grads"]), _largest(reference["grads"].values()))),
        "grad-norm": max(relative(abs(a["grad_norm"] - b["grad_norm"]), b["grad_norm"]) for a, b in pairs),
        "weights": relative(max_diff_tensors(got["params"], reference["params"]),
                            _largest(reference["params"].values())),
    }
    return LayoutResult(draw, diffs), got


def _cell(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def table(results: list[LayoutResult]) -> list[str]:
    """The report: one row per layout, then the overall verdict."""
    rows = [("#", "layout", "batch", *COLUMNS, "tol", "verdict")]
    head = "largest |layout - one process| / max(1, |one process|) over every step, per quantity:"
    for i, res in enumerate(results):
        verdict = "ok" if res.ok else ("FAILED" if res.error else "DIFFERS")
        cells = [_cell(res.diffs.get(c)) for c in COLUMNS] if res.error is None else ["-"] * len(COLUMNS)
        rows.append((str(i), res.draw.describe(), res.draw.describe_plan(), *cells, f"{res.tol:.0e}", verdict))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = [head] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for i, res in enumerate(results):
        if res.error:
            lines.append(f"layout {i} failed: {res.error}")
    bad = sum(not r.ok for r in results)
    lines.append(f"verdict: {bad} of {len(results)} layouts differ from one process or fail" if bad
                 else f"verdict: all {len(results)} layouts match one process")
    return lines


def check_arguments(args) -> None:
    """Bad flags, one line each, before anything starts."""
    for flag, value, low in (("--layouts", args.layouts, 1), ("--steps", args.steps, 1), ("--world", args.world, 2)):
        if value < low:
            raise UserInputError(flag, value, f"must be at least {low}", f"pass {flag} {max(low, 2)}")
    if args.world > 8:
        raise UserInputError("--world", args.world, "more CPU ranks than this check is meant for",
                             "pass --world 2, 4 or 8")


def draw_layouts(cfg, world: int, count: int, seed: int) -> list[LayoutDraw]:
    """``count`` layouts of ``cfg``'s model, shrunk, that ``validate`` accepts on ``world`` ranks."""
    model = shrink_model(cfg.model)
    accept = validated_by(cfg, world)
    return [draw_layout(random.Random(seed * 10 + i), world, model, accept) for i in range(count)]


def run_check_layouts(cfg, args, log=print) -> int:
    """The command, on a loaded and validated ``cfg``: 0 all match, 1 one differs or fails."""
    from megatron_rl.testing.harness import RankError, close_all_pools

    check_arguments(args)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    draws = draw_layouts(cfg, args.world, args.layouts, seed)
    log(f"check-layouts: {args.layouts} layout(s) on {args.world} CPU ranks, {args.steps} step(s), seed {seed} "
        f"(replay: --seed {seed}); the model shrunk to {draws[0].model.num_layers} layers, hidden "
        f"{draws[0].model.hidden_size}, {draws[0].model.num_attention_heads} heads")
    results = []
    references: dict = {}
    try:
        for draw in draws:
            key = repr((draw.model, sorted(draw.optim.items())))
            if key not in references:
                references[key] = reference_run(draw, args.steps)
            try:
                results.append(compare_layout(args.world, draw, references[key])[0])
            except RankError as err:
                results.append(LayoutResult(draw, {}, error=str(err).strip().splitlines()[-1]))
    finally:
        close_all_pools()
    for line in table(results):
        log(line)
    return 0 if all(r.ok for r in results) else 1
