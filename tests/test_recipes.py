"""The algorithm recipes in configs/, DAPO dynamic sampling, and the new algorithm options in real runs.

* dynamic sampling keeps the batch size and always terminates (a fake rollout, fast);
* the 7B / 32k GPU recipes pass config validation for 8 ranks (not run);
* every CPU recipe runs 2 steps; the DAPO recipe learns on the demo task (one seed) and the GSPO
  recipe on the mean of three seeds (slow: about a minute each on an idle 2-core machine);
* rollout correction, overlong shaping and GSPO over context parallelism in a real run.
"""

from __future__ import annotations

import glob
import math
import os

import pytest
import torch

from megatron_rl.testing.harness import run_distributed
from megatron_rl.trainer.dynamic_sampling import fill_batch
from megatron_rl.trainer.experience import Samples
from tests.support.helpers import TINY, read_metrics, train_body

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_RECIPES = ["grpo_cpu", "dapo_cpu", "gspo_cpu", "reinforce_pp_cpu", "grpo_lora_cpu"]
GPU_RECIPES = ["qwen2.5_7b_32k", "dapo_qwen2.5_7b_32k", "gspo_qwen2.5_7b_32k", "reinforce_pp_qwen2.5_7b_32k",
               "grpo_lora_qwen2.5_7b_32k"]
# Every GPU recipe in configs/ and the planner preset of its model; each is for one node of 8 x 80 GB.
PLANNED_RECIPES = {name: "qwen2.5-7b" for name in GPU_RECIPES}
PLANNED_RECIPES.update({"qwen2.5_1.5b_8k": "qwen2.5-1.5b", "qwen3_30b_a3b_32k": "qwen3-30b-a3b",
                        "distill_qwen2.5_7b_to_1.5b_16k": "qwen2.5-1.5b"})
# The distillation teachers of a GPU recipe, as planner presets (their directories are not here).
RECIPE_TEACHERS = {"distill_qwen2.5_7b_to_1.5b_16k": ("qwen2.5-7b",)}
LEARNING_TIMEOUT_S = 900  # a hang guard only: ~1.5 min idle, several on a loaded CI machine


def config_path(name: str) -> str:
    return os.path.join(ROOT, "configs", f"{name}.yaml")


# ----------------------------------------------------------------------------- dynamic sampling


def fake_round(round_: int, prompts: int, n: int, informative_every: int):
    """``prompts`` groups of ``n``; group ``k`` of the round has varied rewards iff ``(round_ * prompts + k) %
    informative_every == 0`` (never when ``informative_every`` is 0)."""
    rows = [(p, j) for p in range(prompts) for j in range(n)]
    uid = [round_ * prompts + p for p, _ in rows]
    samples = Samples(prompt_index=[p for p, _ in rows], dataset_index=uid, prompt_ids=[[1, 2]] * len(rows),
                      response_ids=[[3] * (1 + j) for _, j in rows],
                      rollout_logprob=[[-1.0] * (1 + j) for _, j in rows],
                      finish_reason=["stop"] * len(rows))
    varied = [informative_every and (u % informative_every == 0) for u in uid]
    raw = torch.tensor([float(j % 2) if v else 1.0 for (_, j), v in zip(rows, varied)])
    return samples, raw - 0.1 * torch.tensor([float(j) for _, j in rows]), raw  # shaped scores vary within a group


def test_dynamic_sampling_keeps_the_batch_size_and_terminates():
    prompts, n = 6, 4
    drawn = []

    def draw(round_):
        drawn.append(round_)
        return fake_round(round_, prompts, n, informative_every=3)  # 2 informative groups per round

    out = fill_batch(draw, groups_wanted=prompts, max_rounds=10)
    assert drawn == [0, 1, 2]  # 3 rounds x 2 informative groups = 6: stops as soon as the batch is full
    assert len(out.samples) == prompts * n and out.scores.shape == (prompts * n,)
    assert out.samples.prompt_index == [g for g in range(prompts) for _ in range(n)]
    for rows in out.samples.groups().values():
        uid = {out.samples.dataset_index[r] for r in rows}
        assert len(uid) == 1 and uid.pop() % 3 == 0  # one prompt per group, an informative one
        assert len(set(out.scores[rows].tolist())) == n  # the shaped scores travel with their samples
    assert out.metrics == {"dynamic_sampling/rounds": 3, "dynamic_sampling/prompts_drawn": 18,
                           "dynamic_sampling/kept_groups": 6, "dynamic_sampling/dropped_groups": 12,
                           "dynamic_sampling/padded_groups": 0}
    assert out.drawn_scores.shape == (3 * prompts * n,)
    # more informative groups than needed: the surplus is discarded, one round suffices
    out = fill_batch(lambda r: fake_round(r, prompts, n, informative_every=1), groups_wanted=4, max_rounds=10)
    assert len(out.samples) == 4 * n and out.metrics["dynamic_sampling/rounds"] == 1


def test_dynamic_sampling_fills_up_with_dropped_groups_at_the_bound():
    prompts, n = 5, 3
    calls = []

    def never(round_):  # every group all-equal: sampling more can never fill the batch
        calls.append(round_)
        return fake_round(round_, prompts, n, informative_every=0)

    out = fill_batch(never, groups_wanted=prompts, max_rounds=4)
    assert calls == [0, 1, 2, 3]
    assert len(out.samples) == prompts * n and out.metrics["dynamic_sampling/padded_groups"] == prompts
    # filled with the most recently drawn dropped groups
    assert sorted({out.samples.dataset_index[r] for r in range(len(out.samples))}) == list(range(15, 20))
    # a few informative groups: all kept, the rest padded
    out = fill_batch(lambda r: fake_round(r, prompts, n, informative_every=7), groups_wanted=prompts, max_rounds=2)
    assert out.metrics["dynamic_sampling/kept_groups"] == 2  # uids 0 and 7 of 0..9
    assert out.metrics["dynamic_sampling/padded_groups"] == 3 and len(out.samples) == prompts * n
    with pytest.raises(ValueError):
        fill_batch(never, groups_wanted=0, max_rounds=1)


# ----------------------------------------------------------------------------- recipes


def test_gpu_recipes_validate_for_eight_gpus():
    from megatron_rl.config.loader import load_config
    from megatron_rl.validation import validate

    found = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "configs", "*7b_32k.yaml"))}
    assert set(GPU_RECIPES) <= found
    for name in GPU_RECIPES:
        cfg = load_config(config_path(name))
        validate(cfg, 8)
        assert cfg.rollout.max_new_tokens == 32768 and 8 % (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp) == 0
    assert load_config(config_path("dapo_qwen2.5_7b_32k")).algorithm.dynamic_sampling
    assert load_config(config_path("gspo_qwen2.5_7b_32k")).algorithm.policy_loss == "gspo"
    assert load_config(config_path("reinforce_pp_qwen2.5_7b_32k")).algorithm.advantage == "reinforce_plus_plus"


def test_every_gpu_recipe_is_in_the_table():
    found = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))}
    assert {name for name in found if not name.endswith("_cpu")} == set(PLANNED_RECIPES)


@pytest.mark.parametrize("recipe", sorted(PLANNED_RECIPES))
def test_gpu_recipe_equals_the_plan(recipe):
    """The planner, run for the recipe's model, lengths, critic and reference on 8 x 80 GB, decides
    the recipe's layout, recompute, optimizer sharding, offload, rollout engine, token budget and
    rollout batch (what `megatron-rl plan --model <preset> --config <recipe>` checks)."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.planner.recipe import differences, plan_inputs
    from megatron_rl.planner.search import PRESETS, plan, preset

    cfg = load_config(config_path(recipe))
    model = preset(PLANNED_RECIPES[recipe])
    explicit = {k: v for k, v in PRESETS[PLANNED_RECIPES[recipe]].items() if k != "moe"}
    if cfg.model.num_layers == model.num_layers:  # a recipe that spells the architecture out: the preset's
        assert {k: getattr(cfg.model, k) for k in explicit} == explicit
    inputs = plan_inputs(cfg, tuple(preset(name) for name in RECIPE_TEACHERS.get(recipe, ())))
    result = plan(model, prompt_len=inputs.prompt_len, response_len=inputs.response_len, nodes=1, gpus_per_node=8,
                  gpu_memory_gib=80, with_critic=inputs.with_critic, with_reference=inputs.with_reference,
                  actor_lora=inputs.actor_lora, critic_lora=inputs.critic_lora, teachers=inputs.teachers,
                  teacher_sizes=inputs.teacher_sizes)
    assert result.recommended is not None
    assert differences(cfg, result.recommended.settings(inputs.with_critic)) == []


def test_a_recipe_off_the_plan_is_caught():
    """What the check above sees when a recipe leaves the plan (the 7B recipe's earlier settings)."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.planner.recipe import differences, plan_inputs
    from megatron_rl.planner.search import plan, preset

    old = ["parallel.cp=2", "parallel.cp_comm_type=p2p", "model.recompute.granularity=full", "trainer.offload=true",
           "rollout.max_batch_size=8", "batch.max_tokens_per_rank=16896", "actor.optim.use_distributed_optimizer=false"]
    cfg = load_config(config_path("qwen2.5_7b_32k"), old)
    inputs = plan_inputs(cfg)
    assert (inputs.with_critic, inputs.with_reference) == (False, False)
    best = plan(preset("qwen2.5-7b"), prompt_len=1024, response_len=32768, nodes=1, gpus_per_node=8,
                gpu_memory_gib=80, with_critic=False, with_reference=False).recommended
    assert differences(cfg, best.settings(False)) == [
        ("parallel.cp", 2, 1), ("model.recompute.granularity", "full", None),
        ("actor.optim.use_distributed_optimizer", False, True), ("trainer.offload", True, False),
        ("batch.max_tokens_per_rank", 16896, 33792), ("rollout.max_batch_size", 8, 20)]


def _finite(row: dict) -> bool:
    return all(v is None or math.isfinite(v) for v in row.values() if isinstance(v, float))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", CPU_RECIPES)
def test_cpu_recipe_runs_two_steps(recipe, tmp_path):
    run_distributed(1, train_body, config_path(recipe), ["trainer.steps=2", "trainer.sft_warmup_steps=2",
                                                         f"run.dir={tmp_path}", "run.name=r"])
    rows = read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2] and all(_finite(r) for r in rows)
    assert not any(k.startswith("critic/") for k in rows[0])
    if recipe == "dapo_cpu":
        assert 1 <= rows[0]["dynamic_sampling/rounds"] <= 4 and "reward/overlong_penalty_mean" in rows[0]
    if recipe == "reinforce_pp_cpu":
        assert rows[0]["actor/kl_coef"] == 0.01 and rows[0]["actor/kl_loss"] == 0.0  # the KL is in the reward


# Seeds of the learning runs: one seed's trajectory rides on the CPU's kernels.
LEARNING_SEEDS = (1234, 1, 2)


def _learning_run(recipe: str, steps: int, tmp_path, reward_key: str, seed: int = 1234):
    name = f"r{seed}"
    run_distributed(1, train_body, config_path(recipe), [f"trainer.steps={steps}", f"run.seed={seed}",
                                                         f"run.dir={tmp_path}", f"run.name={name}"],
                    timeout=LEARNING_TIMEOUT_S)
    rows = read_metrics(tmp_path / name)
    assert len(rows) == steps and all(_finite(r) for r in rows)
    rewards = [r[reward_key] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"{recipe} seed {seed}: {reward_key} {first:.3f} (first 5 steps) -> {last:.3f} (last 5 of {steps})")
    return rows, first, last


@pytest.mark.slow
def test_dapo_recipe_learns(tmp_path):
    """The DAPO recipe on add_small: the reward over every drawn sample (before filtering) rises.

    One seed: its rise sits far above the bound on every kernel set.  Rises (first 5 -> last 5 of
    24 steps) measured on one AVX-512 machine, seeds 1234 / 1 / 2, under ``ATEN_CPU_CAPABILITY``
    avx2 0.238 / 0.339 / 0.334, avx512 0.246 / 0.333 / 0.297, default 0.257 / 0.355 / 0.293; with
    ``actor.optim.lr=0`` -0.023.  Asserted: seed 1234's rise >= 0.15."""
    rows, first, last = _learning_run("dapo_cpu", 24, tmp_path, "reward/drawn_mean")
    assert last - first >= 0.15, (first, last)
    assert all(1 <= r["dynamic_sampling/rounds"] <= 4 for r in rows)
    assert any(r["dynamic_sampling/dropped_groups"] > 0 for r in rows)  # the filter acted


@pytest.mark.slow
def test_gspo_recipe_learns(tmp_path):
    """The GSPO recipe on add_small: the mean reward rise over three seeds.

    Rises (first 5 -> last 5 of 24 steps) measured on one AVX-512 machine under torch's three CPU
    kernel sets (``ATEN_CPU_CAPABILITY``), seeds 1234 / 1 / 2: avx2 0.111 / 0.166 / 0.222 (mean
    0.166), avx512 0.128 / 0.175 / 0.230 (0.178), default 0.102 / 0.181 / 0.230 (0.171).  Seed 1234
    alone failed a bound of 0.12 under avx2 and default.  Asserted: the mean >= 0.12 (with
    ``actor.optim.lr=0`` the rise is -0.019)."""
    rises = []
    for seed in LEARNING_SEEDS:
        rows, first, last = _learning_run("gspo_cpu", 24, tmp_path, "reward/mean", seed)
        rises.append(last - first)
        assert max(r["actor/clipfrac"] for r in rows) > 0  # the sequence clip acted on the second mini-batch
    mean = sum(rises) / len(rises)
    print(f"gspo_cpu: mean rise over seeds {LEARNING_SEEDS}: {mean:.3f}")
    assert mean >= 0.12, rises


@pytest.mark.slow
def test_rollout_correction_and_overlong_shaping_in_a_run(tmp_path):
    """GSPO over CP2 with sequence-level TIS, overlong shaping and dynamic sampling: 2 steps, metrics present."""
    overrides = TINY + ["parallel.cp=2", "algorithm.advantage=grpo", "algorithm.policy_loss=gspo",
                        "algorithm.loss_agg=seq-mean-token-mean", "algorithm.rollout_correction.mode=tis",
                        "algorithm.rollout_correction.level=sequence", "algorithm.overlong_buffer=1",
                        "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=2",
                        "trainer.steps=2", f"run.dir={tmp_path}", "run.name=c"]
    run_distributed(2, train_body, None, overrides)
    rows = read_metrics(tmp_path / "c")
    assert len(rows) == 2 and all(_finite(r) for r in rows)
    for row in rows:
        # fp32 on CPU: the trainer recomputes what the engine sampled with, so the weights are ~1
        assert row["rollout_correction/weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert row["rollout_correction/truncated_frac"] == 0.0
        assert -1.0 <= row["reward/overlong_penalty_mean"] <= 0.0
        assert row["dynamic_sampling/rounds"] in (1, 2)
