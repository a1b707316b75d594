"""``rollout.engine=auto``: which engine generates, decided the same way by validation and by the
code that builds the engine."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_rl.config.loader import load_config
from megatron_rl.rollout.choice import (
    AUTO,
    ENGINE_CHOICES,
    MEGATRON,
    TORCH,
    describe_rollout_engine,
    pick_engine,
    rollout_engine,
)
from megatron_rl.rollout.engine import ENGINES
from megatron_rl.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO = os.path.join(ROOT, "configs", "grpo_cpu.yaml")

# (moe, cuda, paged_flash) -> what auto runs, whatever the layout (VPP: a model of its own)
AUTO_CASES = [
    ((False, True, True), MEGATRON),   # a GPU with flash-attn's paged kernels
    ((False, True, False), TORCH),     # a GPU without flash-attn >= 2.7.3
    ((False, False, False), TORCH),    # the CPU: the decoder is faster (docs/rollout.md)
    ((True, False, False), MEGATRON),  # MoE: the only engine with expert layers
    ((True, True, True), MEGATRON),
]


@pytest.mark.parametrize("machine,want", AUTO_CASES)
def test_auto_picks_megatron_where_it_runs_well_and_the_decoder_elsewhere(machine, want):
    moe, cuda, paged_flash = machine
    assert pick_engine(AUTO, moe=moe, cuda=cuda, paged_flash=paged_flash) == want
    for name in ENGINES:  # a name set explicitly is kept
        assert pick_engine(name, moe=moe, cuda=cuda, paged_flash=paged_flash) == name


def test_auto_is_the_default_and_every_other_choice_is_a_registered_engine():
    cfg = load_config(GRPO)
    assert cfg.rollout.engine == AUTO
    assert set(ENGINE_CHOICES) == {AUTO, *ENGINES}


def test_config_and_engine_builder_agree_on_this_machine():
    """What validation reads (``rollout_engine(cfg)``) is the class ``make_rollout_engine`` builds,
    here on the CPU: the decoder for a dense model, megatron's engine for MoE."""
    from megatron_rl.rollout.engine import engine_class, make_rollout_engine

    dense = load_config(GRPO, ["distributed.device=cpu"])
    assert rollout_engine(dense) == TORCH
    assert "auto: on the CPU" in describe_rollout_engine(dense)
    rollout = dataclasses.replace(dense.rollout, max_batch_size=4)  # the trainer derives it when null
    built = make_rollout_engine(rollout, dense.model, "cpu")
    assert type(built) is engine_class(TORCH)
    moe = load_config(GRPO, ["distributed.device=cpu", "model.moe.num_experts=4"])
    assert rollout_engine(moe) == MEGATRON
    assert describe_rollout_engine(moe) == "megatron engine (auto: the only engine with MoE layers)"
    assert describe_rollout_engine(load_config(GRPO, ["rollout.engine=tp_sharded"])) == "tp_sharded engine"


def test_vpp_runs_the_decoder_under_auto_and_megatron_on_a_model_of_its_own():
    layout = ["model.num_layers=4", "parallel.pp=2", "parallel.vpp=2"]
    validate(load_config(GRPO, layout), 2)
    resolution = validate(load_config(GRPO, layout + ["rollout.engine=megatron"]), 2)
    assert "refit from the training shards" in resolution.get("rollout.layout").why


def test_auto_generates_a_vpp_layout_with_megatrons_engine_where_it_runs(monkeypatch):
    """The choice rule alone (no GPU is used): on CUDA with flash-attn's paged kernels a VPP layout
    no longer sends ``auto`` to the decoder, a full weight copy per rank -- megatron's engine
    generates on a model of its own, refit from the interleaved chunks."""
    from megatron_rl.distributed import runtime
    from megatron_rl.rollout import choice

    monkeypatch.setattr(choice, "paged_flash_attention_installed", lambda: True)
    monkeypatch.setattr(runtime, "resolve_device", lambda _distributed: torch.device("cuda"))
    cfg = load_config(GRPO, ["model.num_layers=4", "parallel.pp=2", "parallel.vpp=2"])
    assert rollout_engine(cfg) == MEGATRON
    assert describe_rollout_engine(cfg) == "megatron engine (auto: CUDA with flash-attn's paged kernels)"
