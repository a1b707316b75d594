"""Every ``auto`` and derived value is resolved in one place (:mod:`megatron_rl.resolve`), once,
with its origin; resolving again changes nothing; the run directory's config.yaml keeps what was
asked and notes what it resolved to."""

from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_rl.config.loader import load_config
from megatron_rl.resolve import AUTO_ORIGIN, DERIVED, NOT_IN_CONFIG, SET, Job, resolve
from megatron_rl.utils.run_files import save_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CONFIGS = ["demo_cpu.yaml", "grpo_cpu.yaml", "dapo_cpu.yaml", "gspo_cpu.yaml", "reinforce_pp_cpu.yaml"]
# Modes read when the run starts, not values to resolve: resume=auto picks the newest checkpoint.
MODES = {"trainer.resume"}


def _leaves(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_nothing_auto_is_left_and_resolving_again_changes_nothing(name):
    asked = load_config(os.path.join(ROOT, "configs", name), [])
    once = resolve(asked, 4)
    left = [key for key, value in _leaves(once.config) if value == "auto" and key not in MODES]
    assert left == []
    twice = resolve(once.config, 4)
    assert twice.config == once.config
    assert {v.origin for v in twice.values if v.key not in NOT_IN_CONFIG} == {SET}
    assert [twice.get(k) for k in NOT_IN_CONFIG] == [once.get(k) for k in NOT_IN_CONFIG]
    assert asked.rollout.engine == "auto"  # the user's config is never edited


def test_each_value_says_where_it_came_from():
    asked = load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml"), ["rollout.batching=dynamic"])
    got = resolve(asked, 4)
    assert got.get("rollout.batching").origin == SET and got.get("rollout.batching").value == "dynamic"
    assert got.get("distributed.device").origin == AUTO_ORIGIN
    batch = got.get("rollout.max_batch_size")
    # demo: tp2 x pp2 on 4 ranks -> dp 1; 16 prompts x 8 samples, far inside the KV-cache budget
    assert batch.origin == DERIVED and batch.value == 16 * 8
    assert resolve(asked, 8).get("rollout.max_batch_size").value == 8 * 8  # dp 2
    assert resolve(asked, None).get("rollout.max_batch_size").value is None  # unknown until launch
    old = got.get("algorithm.old_logprobs")
    assert old.origin == AUTO_ORIGIN and old.value == "recompute" and "mini_batches" in old.why


def test_the_derived_rollout_batch_counts_the_kv_cache_a_rank_holds():
    """The KV budget of a derived rollout.max_batch_size is per rank, and a rank of rollout.layout
    holds its stage's layers and its TP share of the KV heads: on TP2 x PP2 a quarter of the
    model's K/V per sequence, so four times the sequences of one rank holding all of it."""
    from megatron_rl.layout.kv import kv_bytes
    from megatron_rl.resolve import ROLLOUT_KV_BUDGET_BYTES

    big = ["model.num_layers=32", "model.hidden_size=4096", "model.ffn_hidden_size=14336",
           "model.num_attention_heads=32", "model.num_query_groups=8", "model.max_position_embeddings=8192",
           "data.max_prompt_tokens=1024", "rollout.max_new_tokens=7168"]
    one = load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml"), [*big, "parallel.tp=1", "parallel.pp=1"])
    whole = kv_bytes(one.model, 8192, 4)  # fp32 on the CPU: 2 GiB per sequence
    assert resolve(one, 1).get("rollout.max_batch_size").value == ROLLOUT_KV_BUDGET_BYTES // whole == 2
    four = load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml"), big)  # tp2 x pp2
    assert kv_bytes(four.model, 8192, 4, tp=2, pp=2) == whole / 4
    assert resolve(four, 4).get("rollout.max_batch_size").value == 8


def test_config_yaml_keeps_what_was_asked_and_notes_what_it_resolved_to(tmp_path):
    asked = load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml"), [])
    notes = resolve(asked, 4).lines()
    save_config(asked, str(tmp_path / "config.yaml"), notes)
    text = (tmp_path / "config.yaml").read_text()
    assert all(f"# {line}" in text for line in notes)
    assert load_config(str(tmp_path / "config.yaml"), []) == asked


def test_the_token_budget_is_resolved_before_launch_for_the_job():
    """The micro-batch token budget is derived once, from the layout, the model and the longest
    sequence the job makes: the config's lengths for training, what ``score`` was given for it."""
    from megatron_rl.data.batching import default_token_budget
    from megatron_rl.data.microbatch import alignment
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.planner.memory import activation_bytes_per_token

    asked = load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml"), ["batch.micro_batch_size=null"])
    got = resolve(asked, 4)
    budget = got.get("batch.token_budget")
    layout = ParallelLayout.from_config(got.config.parallel, 4)
    longest = asked.data.max_prompt_tokens + asked.rollout.max_new_tokens
    want = default_token_budget(longest, activation_bytes_per_token(got.config.model, layout, 4), cp=layout.cp,
                                align=alignment(layout.cp, layout.tp, layout.sequence_parallel))
    assert budget.origin == DERIVED and budget.value == want and budget.value >= longest
    assert resolve(asked, 4, Job(max_seq_len=4 * longest)).get("batch.token_budget").value > want
    assert resolve(asked, None).get("batch.token_budget").value is None  # the layout is known at launch
    for setting in ("batch.micro_batch_size=2", "batch.max_tokens_per_rank=512"):
        fixed = resolve(load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml"), [setting]), 4)
        assert fixed.get("batch.token_budget").value is None and fixed.get("batch.token_budget").origin == SET


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.mode=async", "rollout.ranks=1"], "tis"),  # max_staleness 2: the weights spread, truncated at 2
    (["trainer.mode=async", "rollout.ranks=1", "trainer.max_staleness=1"], "is"),
    (["trainer.mode=one_step_off", "rollout.ranks=1"], "is"),
    (["trainer.mode=one_step_off"], "is"),
    (["trainer.mode=one_step_off", "algorithm.rollout_correction.mode=off"], "off"),
    ([], "off"),
    (["trainer.mode=async", "rollout.ranks=1", "algorithm.rollout_correction.mode=tis"], "tis"),
    (["trainer.mode=async", "rollout.ranks=1", "algorithm.old_logprobs=rollout"], "off"),
])
def test_stale_modes_default_to_decoupled_ppo_and_sync_to_no_correction(overrides, expected):
    cfg = resolve(load_config(os.path.join(ROOT, "configs", "grpo_cpu.yaml"), overrides), 2).config
    assert cfg.algorithm.rollout_correction.mode == expected
    if expected != "off":  # the correction weighs the recomputed (proximal) log-probs against the engine's
        assert cfg.algorithm.old_logprobs == "recompute"
