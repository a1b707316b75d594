"""TRL and verl names: same-meaning ones are accepted with a note, others steer "did you mean"; the
run record says how the job was launched."""

from __future__ import annotations

import os

import pytest
import yaml

from megatron_rl.config import aliases
from megatron_rl.config.loader import ALL_KEYS, load_config
from megatron_rl.errors import ConfigError
from megatron_rl.tools.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")


@pytest.mark.parametrize("typed,ours,value", [
    ("rollout.num_generations", "rollout.n", 8),
    ("num_generations", "rollout.n", 3),
    ("actor_rollout_ref.rollout.n", "rollout.n", 5),
    ("algorithm.beta", "algorithm.kl_coef", 0.25),
    ("actor.optim.learning_rate", "actor.optim.lr", 3e-6),
    ("max_completion_length", "rollout.max_new_tokens", 17),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "batch.max_tokens_per_rank", 4096),
])
def test_same_meaning_alias_is_accepted_with_one_note(capsys, typed, ours, value):
    cfg = load_config(None, [f"{typed}={value}"])
    got = cfg
    for part in ours.split("."):
        got = getattr(got, part)
    assert got == pytest.approx(value)
    err = capsys.readouterr().err
    assert f"{typed} is " in err and f"using {ours}={value}" in err


@pytest.mark.parametrize("typed,fix", [
    ("algorithm.ppo_mini_batch_size", "see algorithm.mini_batches (verl gives prompts per mini-batch"),
    ("data.max_prompt_length", "see data.max_prompt_tokens"),
    ("trainer.lr", "see actor.optim.lr"),
])
def test_different_meaning_alias_is_refused_pointing_at_our_key(typed, fix):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{typed}=4"])
    assert "unknown key" in str(info.value) and fix in str(info.value)


def test_every_alias_points_at_a_real_key():
    for ours, _ in list(aliases.SAME.values()) + list(aliases.SIMILAR.values()):
        assert ours in ALL_KEYS, ours


def test_run_record_says_how_many_processes_were_started(tmp_path, capsys):
    """``config.yaml`` is written before launch with the --nproc the user gave, not the default."""
    code = main(["train", "--config", DEMO, "--nproc", "2", f"run.dir={tmp_path}", "run.name=rec",
                 "parallel.tp=2", "parallel.pp=1", "trainer.steps=1", "trainer.sft_warmup_steps=0",
                 "trainer.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=2", "trainer.plot=false"])
    assert code == 0, capsys.readouterr().err
    record = yaml.safe_load((tmp_path / "rec" / "config.yaml").read_text())
    assert record["distributed"]["nproc"] == 2


def test_reward_module_in_the_working_directory_imports_with_one_process_as_with_many(tmp_path):
    """The console script (not ``python -m``) resolves ``module:function`` beside the user's files."""
    import subprocess
    import sys

    (tmp_path / "my_rewards.py").write_text("def score(prompts, responses, answers, **kw):\n"
                                            "    return [float(len(r) % 2) for r in responses]\n")
    script = os.path.join(os.path.dirname(sys.executable), "megatron-rl")
    proc = subprocess.run([script, "train", "--config", DEMO, "--nproc", "1", "reward.fn=my_rewards:score",
                           f"run.dir={tmp_path}/runs", "parallel.tp=1", "parallel.pp=1", "trainer.steps=1",
                           "trainer.sft_warmup_steps=0", "trainer.prompts_per_step=2", "rollout.n=2",
                           "rollout.max_new_tokens=4", "trainer.plot=false"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "runs").exists()
