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
    int8 = run_distributed(1, measure_body, 8, ("all-linear",), None, "int8")[0]
    plan_full, plan_lora, plan_int8 = planned_bytes(0), planned_bytes(8), planned_bytes(8, quantize_base="int8")
    ratio, ratio_int8 = lora["total"] / full["total"], int8["total"] / full["total"]
    print(_row("full", full, plan_full))
    print(_row("lora r8", lora, plan_lora))
    print(_row("lora r8, int8 base", int8, plan_int8))
    print(f"LoRA / full measured: {ratio:.4f} (int8 base {ratio_int8:.4f}); planned: "
          f"{plan_lora['total'] / plan_full['total']:.4f} ({plan_int8['total'] / plan_full['total']:.4f})")
    # Only the adapters train, as many as layout.lora counts; the reference is the base.
    assert lora["trained_params"] == int8["trained_params"] == adapter_params(ModelConfig(**MEMORY_MODEL),
                                                                               lora_config(8))
    assert full["trained_params"] == full["params"] and lora["reference"] and full["reference"]
    # A bf16 base costs 2 of full fine-tuning's 20 bytes per weight: 0.10 is its floor; int8 halves it.
    assert 0.10 < ratio <= 0.15 and ratio_int8 <= 0.10, (ratio, ratio_int8)
    assert int8["weights"] < 0.6 * lora["weights"] and int8["grads"] == lora["grads"]
    for measured, planned in ((full, plan_full), (lora, plan_lora), (int8, plan_int8)):
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


def test_an_int8_base_is_refused_where_it_would_be_refit_and_planned_in_place(capsys):
    """lora.quantize_base=int8 with a rollout model of its own or generator ranks: one line naming the
    key; the planner keeps its rollout on the actor's shards and counts a byte per weight."""
    import argparse

    import pytest

    from megatron_rl.config.loader import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.tools.plan import add_arguments, run_plan
    from megatron_rl.validation import validate

    recipe = str(ROOT / "configs" / "grpo_lora_cpu.yaml")
    int8 = ["actor.lora.quantize_base=int8"]
    validate(load_config(recipe, int8), 1)
    with pytest.raises(ConfigError, match=r"critic.lora.quantize_base=int8: quantizes a LoRA base, but "
                                          r"critic.lora.rank=0 trains every weight"):
        validate(load_config(recipe, int8 + ["critic.lora.quantize_base=int8"]), 1)
    for extra, world in ((["parallel.tp=2", "rollout.layout.tp=1"], 2), (["rollout.ranks=1", "trainer.mode=async"], 2)):
        with pytest.raises(ConfigError, match=r"actor.lora.quantize_base=int8: an int8 base is held by the training "
                                              r"model only") as err:
            validate(load_config(recipe, int8 + extra), world)
        assert "\n" not in str(err.value)

    def plan(*extra: str) -> str:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        run_plan(parser.parse_args(["--model", "qwen2.5-7b", "--gpus-per-node", "8", "--response-len", "32768",
                                    "--no-critic", "--show", "1", "--lora-rank", "8", *extra]))
        return capsys.readouterr().out

    bf16, int8_plan = plan(), plan("--lora-quantize-base", "int8")
    assert "frozen int8 base" in int8_plan and "frozen bf16 base" in bf16
    assert "(the actor's shards)" in int8_plan.split("rollout.layout:")[1].splitlines()[0]
    with pytest.raises(ConfigError, match="--lora-quantize-base=int8: given without --lora-rank"):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        run_plan(parser.parse_args(["--model", "qwen2.5-7b", "--lora-quantize-base", "int8"]))


def test_an_int8_base_keeps_no_dequantized_weight_for_the_backward_pass():
    """Forward + backward with an int8 base: autograd keeps what it keeps with a bf16 base (the int8
    weights are parameters, not saved activations), and the peak grows by at most the dequantized
    weights of one layer's matmul at a time -- not by a bf16 copy of the base."""
    from megatron_rl.testing.lora_memory import activation_body

    plain = run_distributed(1, activation_body, "none")[0]
    int8 = run_distributed(1, activation_body, "int8")[0]
    print(f"saved for backward: bf16 base {plain['saved']} B, int8 base {int8['saved']} B; peak {plain['peak']} B "
          f"vs {int8['peak']} B (+{int8['peak'] - plain['peak']}; largest dequantized weight "
          f"{int8['largest_weight']} B)")
    assert int8["saved"] == plain["saved"] > 0
    assert int8["peak"] - plain["peak"] <= 3 * int8["largest_weight"]  # fp32 product + its cast, one layer
