"""``rollout.engine`` and ``rollout.batching``: megatron's engine generates on every layout, and how
it batches is decided the same way by config resolution and by the engine when it generates."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_rl.config.choices import AUTO
from megatron_rl.config.loader import load_config
from megatron_rl.rollout.choice import (
    DYNAMIC,
    STATIC,
    batching_refusal,
    describe_rollout_engine,
    pick_batching,
    rollout_batching,
)
from megatron_rl.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO = os.path.join(ROOT, "configs", "grpo_cpu.yaml")

# (moe, partial rollouts, paged kernels) -> what auto batches with
AUTO_CASES = [
    ((False, False, True), DYNAMIC),   # CUDA: flash-attn's or the Triton paged kernels
    ((False, False, False), STATIC),   # the CPU
    ((True, False, False), DYNAMIC),   # MoE: expert-parallel ranks step together
    ((False, True, False), DYNAMIC),   # partial rollouts: re-prefilled on a weight push
]


@pytest.mark.parametrize("facts,want", AUTO_CASES)
def test_auto_batching_is_static_where_the_dynamic_engine_has_no_kernels_and_nothing_needs_it(facts, want):
    named = dict(zip(("moe", "partial", "paged_kernels"), facts))
    assert pick_batching(AUTO, **named) == want
    for name in (DYNAMIC, STATIC):  # a value set explicitly is kept
        assert pick_batching(name, **named) == name
    assert not batching_refusal(want, **named), "auto never picks what cannot run"


def test_megatron_is_the_only_engine_and_auto_names_it():
    """Configs may still say ``auto`` or ``megatron``: both resolve to megatron-core's engine."""
    cfg = load_config(GRPO)
    assert cfg.rollout.engine == AUTO and cfg.rollout.batching == AUTO
    for asked, origin in ((AUTO, "auto"), ("megatron", "set")):
        engine = validate(load_config(GRPO, [f"rollout.engine={asked}"]), 1).get("rollout.engine")
        assert (engine.value, engine.origin) == ("megatron", origin)


def _validate(tmp_path, *overrides: str) -> int:
    from megatron_rl.tools.cli import main

    return main(["validate", GRPO, "--world-size", "1", f"run.dir={tmp_path}/runs", *overrides])


@pytest.mark.parametrize("removed", ["torch", "tp_sharded"])
def test_the_removed_engines_are_refused_with_the_choices(removed, capsys, tmp_path):
    assert _validate(tmp_path, f"rollout.engine={removed}") == 2
    err = capsys.readouterr().err
    assert "rollout.engine" in err and "megatron" in err


def test_config_and_engine_agree_on_this_machine():
    """What resolution reads (``rollout_batching(cfg)``) is what the engine runs, here on the CPU:
    static batching for a dense model, the dynamic engine for MoE."""
    from megatron_rl.rollout.build import make_rollout_engine
    from megatron_rl.rollout.megatron import MegatronRolloutEngine

    dense = load_config(GRPO, ["distributed.device=cpu"])
    assert rollout_batching(dense) == STATIC
    assert "static batching (auto: the CPU: the dynamic engine's per-step scheduling" in describe_rollout_engine(dense)
    rollout = dataclasses.replace(dense.rollout, max_batch_size=4)  # the trainer derives it when null
    built = make_rollout_engine(rollout, dense.model, "cpu")
    assert type(built) is MegatronRolloutEngine
    assert built.batching_now() == STATIC
    moe = load_config(GRPO, ["distributed.device=cpu", "model.moe.num_experts=4"])
    assert rollout_batching(moe) == DYNAMIC
    assert describe_rollout_engine(moe) == "megatron engine, dynamic batching (auto: MoE layers: expert-parallel " \
                                           "ranks step together)"
    assert describe_rollout_engine(load_config(GRPO, ["rollout.batching=dynamic"])) == \
        "megatron engine, dynamic batching"
    resolution = validate(load_config(GRPO, ["distributed.device=cpu"]), 1)
    assert resolution.get("rollout.batching").value == STATIC


def test_static_batching_is_refused_before_launch_where_it_cannot_generate(capsys, tmp_path):
    assert _validate(tmp_path, "rollout.batching=static", "model.moe.num_experts=4", "model.moe.router_topk=2") == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("config error: rollout.batching=static: MoE layers need the dynamic engine"), line
    assert _validate(tmp_path, "rollout.batching=static") == 0


def test_vpp_generates_with_megatrons_engine_on_a_model_of_its_own():
    resolution = validate(load_config(GRPO, ["model.num_layers=4", "parallel.pp=2", "parallel.vpp=2"]), 2)
    assert "refit from the training shards" in resolution.get("rollout.layout").why


def test_auto_batches_dynamically_on_cuda_with_paged_kernels(monkeypatch):
    """The choice rule alone (no GPU is used): on CUDA the dynamic engine, with flash-attn's
    kernels where they import and the Triton kernel without them, CUDA graphs on."""
    from megatron_rl.compat import paged_attention
    from megatron_rl.distributed import runtime
    from megatron_rl.rollout import choice

    monkeypatch.setattr(runtime, "resolve_device", lambda _distributed: torch.device("cuda"))
    cuda = ["model.num_layers=4", "parallel.pp=2", "parallel.vpp=2", "distributed.device=cuda"]
    for flash, kernels in ((False, "triton"), (True, "flash_attn")):
        monkeypatch.setattr(paged_attention, "paged_flash_attention_installed", lambda flash=flash: flash)
        monkeypatch.setattr(choice, "paged_kernels_installed", lambda: True)
        cfg = load_config(GRPO, cuda)
        assert rollout_batching(cfg) == DYNAMIC
        assert describe_rollout_engine(cfg) == \
            "megatron engine, dynamic batching (auto: CUDA with paged attention kernels (flash-attn's or Triton's))"
        resolved = validate(cfg, 2).config
        assert resolved.rollout.paged_attention == kernels and resolved.rollout.cuda_graphs is True
    monkeypatch.setattr(choice, "paged_kernels_installed", lambda: False)  # a CUDA torch without Triton
    assert rollout_batching(load_config(GRPO, cuda)) == STATIC


def test_paged_attention_and_cuda_graphs_resolve_off_cuda_and_are_refused_where_they_cannot_run(capsys, tmp_path):
    resolution = validate(load_config(GRPO, ["distributed.device=cpu", "rollout.batching=dynamic"]), 1)
    assert resolution.get("rollout.paged_attention").value == "sdpa"
    assert resolution.get("rollout.cuda_graphs").value is False
    assert _validate(tmp_path, "rollout.paged_attention=triton", "rollout.batching=dynamic") == 0
    for overrides, start in (
        (["rollout.paged_attention=flash_attn"], "config error: rollout.paged_attention=flash_attn: flash_attn runs "
                                                 "on CUDA only"),
        (["rollout.cuda_graphs=true"], "config error: rollout.cuda_graphs=True: CUDA graphs need CUDA"),
        (["rollout.paged_attention=bogus"], "config error: rollout.paged_attention"),
    ):
        assert _validate(tmp_path, *overrides) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith(start) and "\n" not in line, line
