"""TRL and verl names: same-meaning ones are accepted with a note, the others refused with one line
saying what they are here; "did you mean" only for likely misspellings; the run record says how the
job was launched."""

from __future__ import annotations

import os

import pytest
import yaml

from megatron_rl.config import aliases, verl_keys
from megatron_rl.config.choices import CP_COMM_TYPES
from megatron_rl.config.loader import ALL_KEYS, load_config
from megatron_rl.errors import ConfigError
from megatron_rl.tools.cli import main
from megatron_rl.tools.docs_gen import KEY_NAMES_END, aliases_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")

VERL_KEYS = [line.strip() for line in open(os.path.join(ROOT, "tests", "data", "verl_ppo_megatron_trainer_keys.txt"))
             if line.strip() and not line.startswith("#")]


def _message(overrides) -> str:
    """The note of an accepted override, or the one-line refusal."""
    try:
        load_config(None, overrides)
    except ConfigError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("typed,ours,value", [
    ("rollout.num_generations", "rollout.n", 8),
    ("num_generations", "rollout.n", 3),
    ("actor_rollout_ref.rollout.n", "rollout.n", 5),
    ("algorithm.beta", "algorithm.kl_coef", 0.25),
    ("actor.optim.learning_rate", "actor.optim.lr", 3e-6),
    ("max_completion_length", "rollout.max_new_tokens", 17),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "batch.max_tokens_per_rank", 4096),
    ("actor_rollout_ref.actor.optim.lr", "actor.optim.lr", 1e-6),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "parallel.tp", 2),
    ("actor_rollout_ref.actor.megatron.context_parallel_size", "parallel.cp", 2),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "batch.micro_batch_size", 3),
    ("ppo_micro_batch_size_per_gpu", "batch.micro_batch_size", 5),
    ("actor_rollout_ref.model.path", "model.hf_path", "/models/qwen"),
    ("model.path", "model.hf_path", "/models/llama"),
    ("critic.cliprange_value", "algorithm.value_clip", 0.3),
    ("algorithm.kl_ctrl.target_kl", "algorithm.kl_target", 0.05),
])
def test_same_meaning_alias_is_accepted_with_one_note(capsys, typed, ours, value):
    cfg = load_config(None, [f"{typed}={value}", f"{typed}={value}"])
    got = cfg
    for part in ours.split("."):
        got = getattr(got, part)
    assert got == pytest.approx(value) if not isinstance(value, str) else got == value
    err = capsys.readouterr().err
    assert err.count(f"key {typed} read as our {ours}={value}") == 1, err


@pytest.mark.parametrize("typed,fix", [
    ("critic.ppo_micro_batch_size", "see batch.micro_batch_size (one setting here for every model and pass"),
    ("actor_rollout_ref.rollout.prompt_length", "see data.max_prompt_tokens"),
    ("trainer.lr", "see actor.optim.lr"),
    ("ulysses_sequence_parallel_size", "set parallel.cp=4 parallel.cp_comm_type=a2a"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "set parallel.cp=4 parallel.cp_comm_type=a2a"),
    ("use_kl_loss", "see algorithm.kl_coef"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", "see model.recompute.granularity"),
    ("actor_rollout_ref.actor.optim.betas", "see actor.optim.adam_beta1"),
    ("critic.megatron.tensor_model_parallel_size", "the critic uses the actor's settings: set parallel.tp"),
    ("actor_rollout_ref.ref.megatron.pipeline_model_parallel_size", "reference model uses the actor's settings"),
    ("critic.tensor_model_parallel_size", "did you mean parallel.tp?"),
])
def test_different_meaning_alias_is_refused_pointing_at_our_key(typed, fix):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{typed}=4"])
    assert fix in str(info.value)
    assert "\n" not in str(info.value)


def test_ulysses_size_is_not_sent_to_megatrons_sequence_parallel():
    """verl's Ulysses splits sequences over ranks; parallel.sequence_parallel shards TP activations."""
    text = _message(["ulysses_sequence_parallel_size=2"])
    assert "parallel.cp=2 parallel.cp_comm_type=a2a" in text
    assert "did you mean parallel.sequence_parallel" not in text
    assert "a2a" in CP_COMM_TYPES


@pytest.mark.parametrize("typed,ours", [("actor_rollout_ref.rollout.tensor_model_parallel_size", "tp"),
                                        ("actor_rollout_ref.rollout.pipeline_model_parallel_size", "pp"),
                                        ("actor_rollout_ref.rollout.expert_parallel_size", "ep")])
def test_generation_layout_keys_set_the_rollout_layout_not_the_training_one(typed, ours):
    """In verl these size the inference engine: they are rollout.layout.*, never parallel.*."""
    cfg = load_config(None, [f"{typed}=2"])
    assert getattr(cfg.rollout.layout, ours) == 2 and getattr(cfg.parallel, ours) == 1


def test_the_generation_data_parallel_size_is_refused_as_derived():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor_rollout_ref.rollout.data_parallel_size=2"])
    assert "replicas are the ranks its layout leaves" in str(info.value)


@pytest.mark.parametrize("typed", ["actor_rollout_ref.model.use_liger", "trainer.balance_batch",
                                   "data.return_raw_chat", "actor_rollout_ref.actor.profiler.enable",
                                   "reward_model.enable", "actor_rollout_ref.rollout.multi_turn.enable",
                                   "global_profiler.steps"])
def test_keys_with_no_equivalent_are_refused_saying_so(typed):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{typed}=1"])
    assert "no equivalent here" in str(info.value) and "did you mean" not in str(info.value)


@pytest.mark.parametrize("typed,right,noise", [
    ("actor_rollout_ref.model.path", "model.hf_path", "algorithm.rollout_correction.mode"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "batch.micro_batch_size", "rollout.max_batch_size"),
    ("ppo_micro_batch_size_per_gpu", "batch.micro_batch_size", "smoke.micro_batch_size"),
    ("actor_rollout_ref.actor.use_kl_loss", "algorithm.kl_coef", "rollout.top_k"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", "model.recompute.granularity",
     "actor.init_checkpoint"),
    ("val_files", "data.val_path", "data.shuffle"),
    ("data.val_files", "data.val_path", "data.shuffle"),
    ("test_freq", "trainer.eval_every", "sft_lr"),
    ("trainer.test_freq", "trainer.eval_every", "sft_lr"),
    ("ulysses_sequence_parallel_size", "parallel.cp", "parallel.sequence_parallel="),
])
def test_verl_names_point_at_the_right_key_not_a_look_alike(capsys, typed, right, noise):
    text = _message([f"{typed}=2"]) + capsys.readouterr().err
    assert right in text and noise not in text, text


@pytest.mark.parametrize("typed,ours", [("data.val_files", "data.val_path"),
                                        ("trainer.test_freq", "trainer.eval_every"),
                                        ("actor_rollout_ref.rollout.val_kwargs.n", "eval.n")])
def test_verls_evaluation_keys_are_read_as_ours(capsys, typed, ours):
    load_config(None, [f"{typed}=3"])
    assert f"read as our {ours}=3" in capsys.readouterr().err


@pytest.mark.parametrize("typed,meant", [
    ("actor.optim.lrr", "actor.optim.lr"), ("critic.optim.lrr", "critic.optim.lr"),
    ("rollout.temprature", "rollout.temperature"),
    ("temprature", "eval.temperature or rollout.temperature"),
    ("data.shufle", "data.shuffle"), ("paralel.tp", "parallel.tp"),
    ("max_new_token", "eval.max_new_tokens or rollout.max_new_tokens"),
])
def test_a_typo_still_gets_did_you_mean(typed, meant):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{typed}=1"])
    assert f"did you mean {meant}?" in str(info.value)


@pytest.mark.parametrize("typed", ["foo", "kl_freq", "val_batch", "lr_sched", "trainer.val_freq", "data.val_set"])
def test_an_unlikely_match_gets_no_suggestion(typed):
    assert aliases.suggestion(typed, ALL_KEYS) is None
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"{typed}=1"])
    assert "did you mean" not in str(info.value) and "see docs/config.md" in str(info.value)


@pytest.mark.parametrize("overrides,names", [
    (["actor_rollout_ref.actor.optim.lr=1e-6", "actor.optim.lr=2e-6"],
     ("actor.optim.lr=2e-6", "actor_rollout_ref.actor.optim.lr=1e-6")),
    (["kl_loss_coef=0.1", "actor_rollout_ref.actor.kl_loss_coef=0.2"],
     ("actor_rollout_ref.actor.kl_loss_coef=0.2", "kl_loss_coef=0.1")),
    (["data.train_batch_size=8", "trainer.prompts_per_step=16"], ("trainer.prompts_per_step=16",
                                                                   "data.train_batch_size=8")),
    (["parallel.tp=2", "tensor_model_parallel_size=2", "parallel.tp=4"], ("parallel.tp=4",
                                                                          "tensor_model_parallel_size=2")),
])
def test_two_names_for_one_key_with_different_values_are_refused(capsys, overrides, names):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    text = str(info.value)
    assert all(name in text for name in names) and "give only one of them" in text
    assert capsys.readouterr().err == ""  # the refusal is the only line: no note on a name that was not used


def test_verl_keys_in_a_config_file_are_read_as_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    data_parallel_size: 2\n")
    with pytest.raises(ConfigError, match="rollout.data_parallel_size=2: verl's generation-side setting"):
        load_config(str(path))
    path.write_text("data:\n  train_files: prompts.jsonl\n")
    assert load_config(str(path)).data.train_path == "prompts.jsonl"
    note = "verl key data.train_files=prompts.jsonl read as our data.train_path=prompts.jsonl"
    assert note in capsys.readouterr().err
    path.write_text("actor_rollout_ref: 3\n")
    with pytest.raises(ConfigError, match="section of verl's config: docs/coming_from_trl_verl.md maps its keys"):
        load_config(str(path))


def test_two_names_for_one_key_with_the_same_value_are_fine():
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-6", "actor.optim.lr=0.000001",
                             "parallel.tp=2", "parallel.tp=4"])  # one name twice: the last value, as ever
    assert cfg.actor.optim.lr == pytest.approx(1e-6) and cfg.parallel.tp == 4


def test_every_key_of_verls_megatron_trainer_is_mapped():
    """Each key path of verl's ppo_megatron_trainer.yaml is ours, or the table says what it is here."""
    assert len(VERL_KEYS) > 500
    known = set(ALL_KEYS)
    for key in VERL_KEYS:
        if key in known:
            continue
        match = aliases.lookup(key, known)
        assert match is not None and match.applies, key
        if match.alias.kind == aliases.SAME:
            assert match.alias.ours in known, key
        else:
            problem, fix = aliases.refusal(match, "1", known)
            assert problem and fix and "did you mean" not in fix, key


def test_every_alias_points_at_a_real_key():
    tables = [aliases.TRL, verl_keys.VERL_NAMES, verl_keys.VERL, dict(verl_keys.VERL_GROUPS)]
    for table in tables:
        for name, alias in table.items():
            assert alias.ours is None or alias.ours in ALL_KEYS, (name, alias)
            assert (alias.ours is None) == (alias.kind in (aliases.GENERATION, aliases.NO_EQUIVALENT)), name


def test_key_names_section_keeps_the_rest_of_the_page():
    """The generated section is replaced in place; sections written by hand around it stay."""
    page = aliases_markdown("")
    by_hand = page.replace(KEY_NAMES_END, KEY_NAMES_END + "\n\n## Data format\n\nWritten by hand.")
    by_hand = by_hand.replace("# Coming from TRL or verl\n", "# Coming from TRL or verl\n\nIntro by hand.\n")
    stale_section = by_hand.replace("| `num_generations` | TRL | `rollout.n` |\n", "")
    assert aliases_markdown(stale_section) == by_hand
    assert "Ulysses" in page and "parallel.cp=N parallel.cp_comm_type=a2a" in page


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
