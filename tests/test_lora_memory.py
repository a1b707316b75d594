"""LoRA's memory on one rank, measured after an optimizer step: full fine-tuning (actor and the
frozen reference copy a KL term needs) against LoRA rank 8 on every linear layer (the frozen base,
fp32 adapters with their grads and Adam, no reference copy), and the planner's figure for each."""

from __future__ import annotations

import pathlib

from megatron_rl.testing.harness import run_distributed
from megatron_rl.testing.lora_memory import MEMORY_MODEL, measure_body, planned_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
MiB = 2**20
# The planner's model state against the measured bytes.
PLAN_TOL = 0.10


def _row(name: str, measured: dict, planned: dict) -> str:
    parts = ", ".join(f"{c} {measured[c] / MiB:.2f} (plan {planned[c] / MiB:.2f})"
                      for c in ("weights", "grads", "optimizer"))
    return f"{name}: total {measured['total']} B (plan {planned['total']:.0f} B); MiB: {parts}"


def test_lora_memory_measured_and_planned():
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.layout.lora import adapter_params
    from megatron_rl.testing.lora_memory import lora_config

    full = run_distributed(1, measure_body, 0)[0]
    lora = run_distributed(1, measure_body, 8)[0]
    plan_full, plan_lora = planned_bytes(0), planned_bytes(8)
    ratio = lora["total"] / full["total"]
    print(_row("full", full, plan_full))
    print(_row("lora r8", lora, plan_lora))
    print(f"LoRA / full measured: {ratio:.4f}; planned: {plan_lora['total'] / plan_full['total']:.4f}")
    # Only the adapters train, as many as layout.lora counts; the reference is the base.
    assert lora["trained_params"] == adapter_params(ModelConfig(**MEMORY_MODEL), lora_config(8))
    assert full["trained_params"] == full["params"] and lora["reference"] and full["reference"]
    assert ratio <= 0.15, ratio
    for measured, planned in ((full, plan_full), (lora, plan_lora)):
        assert abs(planned["total"] - measured["total"]) <= PLAN_TOL * measured["total"], (measured, planned)


def test_plan_names_lora_lines_and_counts_no_reference_copy(capsys):
    """``megatron-rl plan --lora-rank``: the frozen base and the adapters' weights, grads and Adam on
    their own lines and no reference copy; a recipe's actor.lora plans the same way."""
    import argparse
    import re

    from megatron_rl.config.loader import load_config
    from megatron_rl.layout.lora import adapter_params
    from megatron_rl.planner.recipe import plan_inputs
    from megatron_rl.planner.search import preset
    from megatron_rl.testing.lora_memory import lora_config
    from megatron_rl.tools.plan import add_arguments, run_plan

    def plan(*extra: str) -> str:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        run_plan(parser.parse_args(["--model", "qwen2.5-0.5b", "--gpus-per-node", "2", "--response-len", "2048",
                                    "--no-critic", "--show", "2", *extra]))
        return capsys.readouterr().out

    full, lora = plan(), plan("--lora-rank", "8")
    assert "LoRA" not in full and "reference)" in full
    assert "actor with LoRA rank 8 on all-linear" in lora and "reference = the actor's base" in lora
    tp, pp = map(int, re.search(r"recommended: tp(\d+) pp(\d+)", lora).groups())
    count = adapter_params(preset("qwen2.5-0.5b"), lora_config(8), tp) / pp
    line = next(x for x in lora.splitlines() if x.startswith("actor LoRA:"))
    assert f"{count / 1e6:.2f}M adapter parameters per GPU" in line and "LoRA optimizer" in line
    recipe = load_config(str(ROOT / "configs" / "grpo_lora_cpu.yaml"))
    assert plan_inputs(recipe).actor_lora == recipe.actor.lora and recipe.actor.lora.rank > 0
