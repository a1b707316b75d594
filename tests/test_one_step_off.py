"""trainer.mode=one_step_off: step k trains on samples generated with the weights before update
k-1 (one policy version stale), the batch for step k+1 generated with the weights step k starts
from; the batch waiting for the next step is part of every checkpoint."""

from __future__ import annotations

import pytest

from megatron_rl.testing.harness import run_distributed
from tests.support.helpers import ppo_body, read_metrics

OFF = "trainer.mode=one_step_off"
# Keys that differ between modes by design (staleness, versions) or by the clock.
VOLATILE = ("timing/", "memory/", "throughput/", "rollout/staleness", "rollout/policy_version", "rollout/weights_gb")


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def test_with_frozen_weights_one_step_off_trains_on_the_sync_batches(tmp_path):
    """With nothing learning, staleness cannot matter: the same prompts, samples, rewards and
    losses as a synchronous run, step by step (the batch order and seeds are the same)."""
    # No re-weighting either (one_step_off's default, decoupled PPO, weighs the behaviour log-probs
    # against the recomputed ones, which differ from them by the last bits).
    frozen = ["actor.optim.lr=0", "critic.optim.lr=0", "trainer.steps=3", f"run.dir={tmp_path}",
              "algorithm.rollout_correction.mode=off"]
    run_distributed(2, ppo_body, frozen + ["run.name=sync"])
    run_distributed(2, ppo_body, frozen + ["run.name=off", OFF])
    sync, off = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "off")
    assert _stable(off) == _stable(sync)
    assert [r["rollout/staleness_max"] for r in off] == [0, 1, 1]
    assert [r["rollout/staleness_max"] for r in sync] == [0, 0, 0]


def test_one_step_off_samples_are_one_update_stale(tmp_path):
    """Learning: every batch after the first was generated one update before the weights it
    trains from, so the rollout's log-probs differ from the recomputed ones there, and only there."""
    run_distributed(2, ppo_body, ["trainer.steps=4", "actor.optim.lr=0.01", f"run.dir={tmp_path}", "run.name=off",
                                  OFF])
    rows = read_metrics(tmp_path / "off")
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert [r["rollout/policy_version"] for r in rows] == [0, 0, 1, 2]
    mismatch = [r["rollout/logprob_mismatch_max"] for r in rows]
    print("rollout vs recomputed log-prob, max per step:", ", ".join(f"{m:.2g}" for m in mismatch))
    assert mismatch[0] < 1e-4, mismatch
    assert all(m > 1e-3 for m in mismatch[1:]), mismatch


def preempted_ppo_body(overrides: list[str], fault: str):
    """:func:`ppo_body` with a fault injected (``MEGATRON_RL_FAULT``) in this worker."""
    import os

    os.environ["MEGATRON_RL_FAULT"] = fault
    try:
        return ppo_body(overrides)
    finally:
        del os.environ["MEGATRON_RL_FAULT"]


@pytest.mark.slow
def test_one_step_off_resumes_exactly_with_the_waiting_batch_from_the_checkpoint(tmp_path):
    """Preempted during step 3 of 4 (it checkpoints after step 3 and exits) and resumed, the run
    logs what the straight run logs: the batch step 4 trains on, generated at step 3 with the
    weights of 2 updates, comes from the checkpoint instead of being generated again."""
    common = [OFF, "actor.optim.lr=0.01", "trainer.steps=4", f"run.dir={tmp_path}"]
    run_distributed(2, ppo_body, common + ["run.name=straight"])
    run_distributed(2, preempted_ppo_body, common + ["run.name=resumed"], "sigterm@rank=0:step=3")
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3]
    run_distributed(2, ppo_body, common + ["run.name=resumed"])
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert _stable(resumed) == _stable(straight)
    assert [r["rollout/staleness_max"] for r in resumed] == [0, 1, 1, 1]


def test_a_sync_run_resumed_from_one_step_off_trains_the_waiting_batch_first(tmp_path):
    """Switching to sync at a resume loses no prompts: the batch generated ahead is trained first
    (staleness 1 once), then each step generates what it trains; the prompts are the straight
    run's, which draws the same batches in the same order.  The correction is pinned: ``auto``
    resolves it from trainer.mode, which the resume changes."""
    common = ["actor.optim.lr=0.01", "trainer.steps=4", f"run.dir={tmp_path}", "algorithm.rollout_correction.mode=is"]
    run_distributed(1, preempted_ppo_body, common + [OFF, "run.name=switched"], "sigterm@rank=0:step=2")
    run_distributed(1, ppo_body, common + ["run.name=switched"])
    run_distributed(1, ppo_body, common + [OFF, "run.name=straight"])
    switched, straight = read_metrics(tmp_path / "switched"), read_metrics(tmp_path / "straight")
    assert [r["rollout/staleness_max"] for r in switched] == [0, 1, 1, 0]
    assert [r["rollout/policy_version"] for r in switched] == [0, 0, 1, 3]
    assert _stable(switched[:3]) == _stable(straight[:3])  # up to the switch: the one_step_off run


@pytest.mark.slow
def test_grpo_learns_the_demo_task_one_step_off_as_sync_does(tmp_path):
    """configs/grpo_cpu.yaml (add_small) in both modes, same steps and samples: the reward rises
    one step off, by at least half of what the synchronous run gains."""
    import os
    import time

    from tests.support.helpers import train_body

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "grpo_cpu.yaml")
    rises = {}
    for mode in ("sync", "one_step_off"):
        start = time.monotonic()
        run_distributed(1, train_body, config, [f"trainer.mode={mode}", "trainer.steps=20", f"run.dir={tmp_path}",
                                                f"run.name={mode}"], timeout=900)
        rewards = [r["reward/mean"] for r in read_metrics(tmp_path / mode)]
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        rises[mode] = last - first
        print(f"GRPO {mode}: reward {first:.3f} (first 5 steps) -> {last:.3f} (last 5 of {len(rewards)}) in "
              f"{time.monotonic() - start:.0f} s")
    assert rises["one_step_off"] >= 0.12 and rises["one_step_off"] >= 0.5 * rises["sync"], rises


@pytest.mark.parametrize("overrides,key", [
    (["algorithm.advantage=grpo", "rollout.n=4", "algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling"),
    (["algorithm.old_logprobs=rollout"], "algorithm.old_logprobs"),
])
def test_one_step_off_refuses_what_it_cannot_train_before_launch(overrides, key):
    from megatron_rl.config.loader import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.validation import validate
    from tests.support.helpers import TINY

    validate(load_config(None, TINY + overrides), 1)  # fine in sync mode
    with pytest.raises(ConfigError, match=key):
        validate(load_config(None, TINY + overrides + [OFF]), 1)
