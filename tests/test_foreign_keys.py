"""TRL and verl names read by their value, in a YAML file as on the command line, and every refused
key of a run reported in one error."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from megatron_rl.config.loader import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.testing.cli_runner import run_cli
from megatron_rl.tools.cli import main

# verl's examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh (35 keys) and five keys its sibling
# run_qwen2-7b_megatron.sh adds: 40 keys of a megatron PPO run as a verl user types them.
VERL_MEGATRON_PPO = [
    "algorithm.adv_estimator=gae",
    "data.train_files=['/data/gsm8k/train.parquet','/data/math/train.parquet']",
    "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=1024",
    "data.max_prompt_length=1024",
    "data.max_response_length=512",
    "data.filter_overlong_prompts=True",
    "data.truncation='error'",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.optim.lr=1e-5",
    "critic.model.path=Qwen/Qwen2-7B-Instruct",
    "critic.model.enable_gradient_checkpointing=False",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "critic.megatron.pipeline_model_parallel_size=2",
    "critic.megatron.tensor_model_parallel_size=2",
    "algorithm.use_kl_in_reward=False",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.critic_warmup=0",
    "trainer.logger=['console','wandb']",
    "trainer.project_name='verl_ppo_gsm8k_math_examples'",
    "trainer.experiment_name='qwen2_7b_megatron'",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.val_before_train=True",
    "trainer.total_epochs=100",
]
# What cannot run as typed here: two training files, vLLM's memory share, epochs without a step count.
VERL_REFUSED = ["data.train_files", "actor_rollout_ref.rollout.gpu_memory_utilization", "trainer.total_epochs"]


@pytest.fixture(autouse=True)
def _notes_of_this_test_only(monkeypatch):
    """Each note is printed once per process: a test here neither hides nor spends another's."""
    from megatron_rl.config import loader

    monkeypatch.setattr(loader, "_NOTED", set())


def _refusal(overrides, path=None, world_size=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, world_size=world_size)
    return str(info.value)


def _get(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


# ---------------------------------------------------------------- one error for every refused key


def test_every_refused_key_of_verls_megatron_ppo_command_is_reported_at_once():
    assert len(VERL_MEGATRON_PPO) == 40
    text = _refusal(VERL_MEGATRON_PPO)
    lines = text.splitlines()
    assert lines[0] == f"config error: {len(VERL_REFUSED)} settings refused, each with its fix:", text
    refused = [line.split("=", 1)[0].strip() for line in lines[1:]]
    assert sorted(refused) == sorted(VERL_REFUSED), text
    assert all("; fix: " in line for line in lines[1:]), text


def test_the_command_line_prints_every_refusal_and_exits_2(capsys):
    code = main(["validate", *VERL_MEGATRON_PPO])
    err = capsys.readouterr().err
    assert code == 2
    assert sum("; fix: " in line for line in err.splitlines()) == len(VERL_REFUSED), err


def test_unknown_keys_of_a_file_and_the_command_line_come_in_one_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  tq: 2\ntrainer:\n  stepz: 3\n")
    text = _refusal(["rollout.nn=2", "actor.optim.lr=fast"], str(path))
    assert text.splitlines()[0] == "config error: 4 settings refused, each with its fix:"
    for part in ("parallel.tq=2: unknown key (from", "did you mean parallel.tp?", "trainer.stepz=3: unknown key",
                 "rollout.nn=2: unknown key (from the command line)", "actor.optim.lr=fast: wrong type"):
        assert part in text, text


def test_one_refused_key_stays_one_line():
    text = _refusal(["parallel.tpp=2"])
    assert text == "config error: parallel.tpp=2: unknown key (from the command line); fix: did you mean parallel.tp?"


# ---------------------------------------------------------------- verl values that run here


@pytest.mark.parametrize("overrides,key,expected,note", [
    (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", "parallel.tp=2"], "parallel.tp", 2,
     "the reference model runs on the actor's layout"),
    (["critic.megatron.pipeline_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"], "parallel.pp", 2, "actor's layout"),
    (["trainer.n_gpus_per_node=2", "trainer.nnodes=1"], "distributed.nproc", 2, "processes on this machine"),
    (["actor_rollout_ref.rollout.name=vllm"], "rollout.engine", "auto", "megatron-core's inference engine"),
    (["trainer.logger=['console','tensorboard']"], "trainer.tensorboard", True, "console always"),
    (["trainer.logger=['console','wandb']"], "trainer.wandb", True, "console always"),
    (["trainer.project_name=math"], "run.dir", "runs/math", "run.dir/<project>"),
    (["trainer.total_epochs=15", "trainer.total_training_steps=7"], "trainer.steps", 7, "the epochs count is not used"),
    (["trainer.critic_warmup=0"], "trainer.steps", 20, "no critic warm-up"),
    (["data.max_prompt_length=100"], "data.max_prompt_tokens", 100, "dropped and counted"),
    (["data.filter_overlong_prompts=True", "data.truncation=error"], "data.max_prompt_tokens", 512,
     "dropped and counted"),
    (["actor_rollout_ref.actor.use_kl_loss=True"], "algorithm.kl_coef", 0.001, "verl's kl_loss_coef default"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01"],
     "algorithm.kl_coef", 0.01, "into the loss with algorithm.kl_coef=0.01"),
    (["actor_rollout_ref.actor.use_kl_loss=False"], "algorithm.kl_coef", 0.0, "no KL in the loss"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=8", "rollout.n=3"],
     "algorithm.mini_batches", 2, "4 prompts x rollout.n=3 samples"),
    (["critic.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
      "data.train_batch_size=8"], "algorithm.mini_batches", 4, "mini-batches"),
    (["algorithm.kl_ctrl.kl_coef=0.002", "algorithm.use_kl_in_reward=True"], "algorithm.kl_coef", 0.002,
     "in-reward KL"),
    (["algorithm.kl_ctrl.kl_coef=0.002"], "algorithm.kl_coef", 0.0, "unused while algorithm.kl_in_reward=false"),
    (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3", "batch.micro_batch_size=3"],
     "batch.micro_batch_size", 3, "one setting here for every model and pass"),
    (["critic.model.enable_gradient_checkpointing=True"], "model.recompute.granularity", "full", "recompute"),
    (["trainer.save_freq=-1"], "trainer.save_every", 0, "only at the end"),
    (["trainer.test_freq=-1"], "trainer.eval_every", 0, "no evaluation"),
    (["data.train_files=['/data/gsm8k/train.parquet']"], "data.train_path", "/data/gsm8k/train.parquet",
     "read as our data.train_path=/data/gsm8k/train.parquet (one file)"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "rollout.layout.tp", 2, "rollout.layout.tp"),
])
def test_verl_values_that_mean_ours_are_accepted_with_a_note(capsys, overrides, key, expected, note):
    cfg = load_config(None, overrides)
    assert _get(cfg, key) == pytest.approx(expected) if isinstance(expected, float) else _get(cfg, key) == expected
    err = capsys.readouterr().err
    assert note in err, err


@pytest.mark.parametrize("overrides,fix", [
    (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4", "parallel.tp=2"],
     "the reference model uses the actor's settings: set parallel.tp"),
    (["trainer.n_gpus_per_node=8", "trainer.nnodes=2"], "torchrun or srun"),
    (["actor_rollout_ref.rollout.name=trtllm-x"], "rollout.engine"),
    (["trainer.logger=['console','mlflow']"], "trainer.tensorboard"),
    (["trainer.total_epochs=3"], "trainer.steps"),
    (["trainer.critic_warmup=5"], "remove it"),
    (["data.truncation=left"], "data.max_prompt_tokens"),
    (["data.truncation=error"], "data.filter_overlong_prompts=True"),
    (["data.filter_overlong_prompts=False"], "data.max_prompt_tokens"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=3", "data.train_batch_size=8"], "algorithm.mini_batches"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_in_reward=True"], "algorithm.kl_in_reward"),
    (["actor_rollout_ref.actor.use_kl_loss=False", "algorithm.kl_coef=0.1"], "algorithm.kl_in_reward"),
    (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "batch.micro_batch_size=2"],
     "batch.micro_batch_size"),
])
def test_verl_values_that_cannot_run_are_refused_naming_our_key(overrides, fix):
    text = _refusal(overrides)
    assert fix in text and "\n" not in text, text


def test_verls_gpu_count_must_match_the_world_size():
    assert load_config(None, ["trainer.n_gpus_per_node=4"], world_size=4).distributed.nproc == 4
    text = _refusal(["trainer.n_gpus_per_node=8", "trainer.nnodes=1"], world_size=4)
    assert "8 processes" in text and "4" in text and "\n" not in text, text
    assert load_config(None, ["trainer.n_gpus_per_node=4", "trainer.nnodes=2"], world_size=8)


def test_the_launcher_refuses_a_gpu_count_other_than_nproc(capsys):
    code = main(["validate", "--world-size", "2", "trainer.n_gpus_per_node=4"])
    assert code == 2 and "trainer.n_gpus_per_node=4" in capsys.readouterr().err


# ---------------------------------------------------------------- verl's custom reward function


@pytest.mark.parametrize("overrides,expected", [
    (["custom_reward_function.path=/work/my_reward.py", "custom_reward_function.name=score"],
     "/work/my_reward.py:score"),
    (["custom_reward_function.path=/work/my_reward.py"], "/work/my_reward.py:compute_score"),
    (["reward.fn=/work/my_reward.py:compute_score", "custom_reward_function.name=other"], "/work/my_reward.py:other"),
])
def test_verls_custom_reward_function_is_our_reward_fn(capsys, tmp_path, overrides, expected):
    assert load_config(None, overrides).reward.fn == expected
    assert f"reward.fn={expected}" in capsys.readouterr().err
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_nested(overrides)))
    assert load_config(str(path)).reward.fn == expected


def test_a_reward_name_without_a_path_is_refused():
    assert "custom_reward_function.path" in _refusal(["custom_reward_function.name=score"])


# ---------------------------------------------------------------- TRL names


@pytest.mark.parametrize("overrides,key,expected", [
    (["loss_type=dr_grpo"], "algorithm.loss_agg", "seq-mean-token-sum-norm"),
    (["loss_type=grpo"], "algorithm.loss_agg", "seq-mean-token-mean"),
    (["loss_type=dapo"], "algorithm.loss_agg", "token-mean"),
    (["loss_type=bnpo"], "algorithm.loss_agg", "token-mean"),
    (["scale_rewards=false"], "algorithm.norm_by_std", False),
    (["scale_rewards=none"], "algorithm.norm_by_std", False),
    (["scale_rewards=group"], "algorithm.norm_by_std", True),
    (["scale_rewards=true"], "algorithm.norm_by_std", True),
    (["mask_truncated_completions=false"], "algorithm.overlong_buffer", 0),
    (["steps_per_generation=4"], "algorithm.mini_batches", 4),
    (["importance_sampling_level=sequence"], "algorithm.policy_loss", "gspo"),
    (["importance_sampling_level=token"], "algorithm.policy_loss", "ppo"),
    (["num_train_epochs=3", "max_steps=10"], "trainer.steps", 10),
    (["bf16=true"], "model.params_dtype", "bfloat16"),
    (["bf16=false"], "model.params_dtype", "float32"),
    (["report_to=tensorboard"], "trainer.tensorboard", True),
    (["report_to=[tensorboard,wandb]"], "trainer.wandb", True),
    (["report_to=none", "trainer.tensorboard=false"], "trainer.tensorboard", False),
    (["logging_steps=5"], "trainer.log_every", 5),
    (["use_vllm=true"], "rollout.engine", "auto"),
    (["log_completions=true"], "trainer.log_samples", True),
])
def test_trl_names_with_an_equivalent_are_read_as_ours_with_one_note(capsys, overrides, key, expected):
    assert _get(load_config(None, overrides), key) == expected
    err = capsys.readouterr().err
    typed = overrides[0].split("=")[0]
    assert err.count(f"config: TRL key {typed}") == 1, err


@pytest.mark.parametrize("typed,fix", [
    ("scale_rewards=batch", "algorithm.norm_by_std"),
    ("mask_truncated_completions=true", "algorithm.overlong_buffer"),
    ("gradient_accumulation_steps=4", "algorithm.mini_batches"),
    ("num_train_epochs=3", "trainer.steps"),
    ("report_to=mlflow", "trainer.tensorboard"),
    ("loss_type=sapo", "algorithm.loss_agg"),
    ("importance_sampling_level=sequence_token", "algorithm.policy_loss"),
    ("steps_per_generation=0", "algorithm.mini_batches"),
])
def test_trl_names_without_an_equivalent_are_refused_pointing_at_ours(typed, fix):
    text = _refusal([typed])
    assert fix in text and "TRL" in text and "\n" not in text, text


def _nested(overrides) -> dict:
    """``a.b=v`` overrides as the YAML mapping a file would hold."""
    root: dict = {}
    for item in overrides:
        key, value = item.split("=", 1)
        parts = key.split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(value)
    return root


TRL_RUN = ["loss_type=dr_grpo", "scale_rewards=false", "bf16=true", "report_to=[tensorboard]", "logging_steps=5",
           "num_generations=4", "learning_rate=1e-5", "steps_per_generation=2", "log_completions=true",
           "use_vllm=true", "max_steps=3", "num_train_epochs=1", "importance_sampling_level=sequence",
           "mask_truncated_completions=false", "custom_reward_function.path=/r.py",
           "actor_rollout_ref.actor.ppo_mini_batch_size=8", "data.train_batch_size=16",
           "trainer.logger=['console']", "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"]


def _noted_keys(err: str) -> list[str]:
    """The names the notes are about (a value reads ``[a]`` typed, ``["a"]`` from YAML)."""
    return sorted(line.split("=", 1)[0] for line in err.splitlines())


def test_trl_and_verl_names_in_a_yaml_file_give_what_the_command_line_gives(tmp_path, capsys, monkeypatch):
    from megatron_rl.config import loader

    from_cli = load_config(None, TRL_RUN)
    cli_notes = capsys.readouterr().err
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(_nested(TRL_RUN)))
    monkeypatch.setattr(loader, "_NOTED", set())  # each note is printed once per process
    assert load_config(str(path)) == from_cli
    assert _noted_keys(capsys.readouterr().err) == _noted_keys(cli_notes) and len(cli_notes.splitlines()) == 19


def test_refusals_in_a_file_are_the_command_lines(tmp_path):
    bad = ["scale_rewards=batch", "trainer.critic_warmup=3"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_nested(bad)))
    from_file = _refusal([], str(path)).splitlines()[1:]
    from_cli = _refusal(bad).splitlines()[1:]
    assert [line.replace(f"(from {path})", "") for line in from_file] == from_cli


def test_a_verl_yaml_file_with_its_nested_sections_runs(tmp_path):
    overrides = [o for o in VERL_MEGATRON_PPO if o.split("=")[0] not in VERL_REFUSED]
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(_nested(overrides)))
    cfg = load_config(str(path), ["trainer.total_training_steps=3"])
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.distributed.nproc) == (2, 2, 8)
    assert cfg.algorithm.mini_batches == 4 and cfg.trainer.wandb and cfg.run.name == "qwen2_7b_megatron"
    assert json.dumps(cfg.data.val_path) == '"/data/gsm8k/test.parquet"'
    assert os.path.basename(cfg.run.dir) == "verl_ppo_gsm8k_math_examples"


# ---------------------------------------------------------------- end to end

VERL_TINY_RUN = [  # verl's names for everything the tiny run sets that verl has a name for
    "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "data.train_batch_size=4", "data.max_prompt_length=40",
    "data.max_response_length=3", "data.filter_overlong_prompts=True", "data.truncation='error'",
    "actor_rollout_ref.actor.optim.lr=0.003", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.05", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1", "algorithm.adv_estimator=grpo",
    "custom_reward_function.path=tests/data/verl_rewards.py", "trainer.critic_warmup=0",
    "trainer.logger=['console','tensorboard']", "trainer.project_name=proj", "trainer.experiment_name=verl",
    "trainer.total_training_steps=2", "trainer.total_epochs=1", "trainer.test_freq=2", "trainer.val_before_train=True",
]


def _verl_rows(path, n: int = 4) -> str:
    """verl's gsm8k rows as its preprocessing writes them: a Parquet file."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+{i}="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.slow
def test_verls_files_with_verls_key_names_in_one_run(tmp_path):

    from tests.support.helpers import TINY, read_metrics

    path = _verl_rows(tmp_path / "train.parquet")
    renamed = {"data.train_path", "data.max_prompt_tokens", "reward.fn", "rollout.n", "rollout.max_new_tokens",
               "trainer.prompts_per_step", "actor.optim.lr", "batch.micro_batch_size", "algorithm.kl_coef",
               "algorithm.mini_batches"}
    ours = [item for item in TINY if item.split("=")[0] not in renamed]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = run_cli("train", *ours, *VERL_TINY_RUN, f"data.train_files={path}", f"data.val_files={path}",
                   f"run.dir={tmp_path}", cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "proj" / "verl"
    rows = [row for row in read_metrics(run) if "reward/mean" in row]
    # 1.0 exactly: verl's compute_score, named by custom_reward_function.path, got every record field.
    assert [row["reward/mean"] for row in rows] == [1.0, 1.0]
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert record["algorithm"]["mini_batches"] == 2 and record["algorithm"]["kl_coef"] == pytest.approx(0.05)
    assert record["reward"]["fn"] == "tests/data/verl_rewards.py:compute_score"
    assert record["trainer"]["tensorboard"] and (run / "tb").is_dir()
    assert "config: verl key actor_rollout_ref.rollout.name=vllm accepted" in proc.stderr
