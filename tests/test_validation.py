"""Every class of bad value is refused before any process starts: one line naming the key, the
value and the fix, exit code 2, and nothing written to the run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.config.loader import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.testing.cli_runner import run_cli
from megatron_rl.tools.cli import main
from megatron_rl.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")


def refused(capsys, tmp_path, *overrides: str, world: int = 4) -> str:
    """Run ``megatron-rl validate DEMO --world-size N overrides``; return its one stderr line."""
    code = main(["validate", DEMO, "--world-size", str(world), f"run.dir={tmp_path}/runs", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    assert "fix:" in lines[0]
    assert not (tmp_path / "runs").exists()
    return lines[0]


UNKNOWN_CHOICES = [
    ("model.activation", "bogus", "swiglu, gelu"),
    ("model.normalization", "bogus", "RMSNorm, LayerNorm"),
    ("model.params_dtype", "fp8", "bfloat16"),
    ("model.transformer_impl", "te", "transformer_engine"),
    ("model.recompute.granularity", "partial", "full, selective"),
    ("actor.optim.schedule", "bogus", "constant, linear, cosine"),
    ("critic.optim.schedule", "cosin", "did you mean cosine?"),
    ("parallel.cp_comm_type", "bogus", "p2p, all_gather, a2a, a2a+p2p"),
    ("distributed.backend", "mpi", "nccl, gloo"),
    ("distributed.device", "tpu", "cuda, cpu"),
    ("trainer.sft_answers", "maybe", "true, shuffled"),
    ("algorithm.kl_controller", "pid", "fixed, adaptive"),
    # registries: read from the module that implements them
    ("algorithm.advantage", "ppo", "gae, grpo, rloo"),
    ("algorithm.kl_kind", "k4", "low_var_kl"),
    ("algorithm.loss_agg", "mean", "token-mean"),
    ("rollout.engine", "vllm", "auto, megatron"),
    ("rollout.batching", "paged", "auto, dynamic, static"),
]


@pytest.mark.parametrize("key,value,listed", UNKNOWN_CHOICES)
def test_unknown_choice_is_refused_with_the_choices(capsys, tmp_path, key, value, listed):
    line = refused(capsys, tmp_path, f"{key}={value}")
    assert line.startswith(f"config error: {key}={value}: unknown choice; fix:"), line
    assert listed in line


OUT_OF_RANGE = [
    ("rollout.temperature", "-1", ">= 0"),
    ("rollout.top_p", "1.5", "<= 1"),
    ("rollout.top_p", "0", "> 0"),
    ("rollout.top_k", "-1", ">= 0"),
    ("rollout.n", "0", ">= 1"),
    ("actor.optim.lr", "-1e-5", ">= 0"),
    ("critic.optim.min_lr", "-1", ">= 0"),
    ("actor.optim.adam_beta2", "1.0", "< 1"),
    ("algorithm.clip_low", "-0.1", ">= 0"),
    ("algorithm.clip_high", "-0.2", ">= 0"),
    ("algorithm.dual_clip", "0.5", "> 1"),
    ("algorithm.value_clip", "0", "> 0"),
    ("algorithm.gamma", "1.5", "<= 1"),
    ("batch.micro_batch_size", "0", ">= 1"),
    ("batch.max_tokens_per_rank", "0", ">= 1"),
    ("trainer.prompts_per_step", "0", ">= 1"),
    ("trainer.keep_last", "0", ">= 1"),
    # checked before the layout arithmetic, which used to divide by it
    ("parallel.tp", "0", ">= 1"),
    ("parallel.cp", "-2", ">= 1"),
]


@pytest.mark.parametrize("key,value,bound", OUT_OF_RANGE)
def test_out_of_range_number_is_refused(capsys, tmp_path, key, value, bound):
    line = refused(capsys, tmp_path, f"{key}={value}")
    assert line.startswith(f"config error: {key}="), line
    assert f"out of range (must be {bound}" in line or f"and {bound}" in line, line


def test_prompt_file_that_does_not_exist(capsys, tmp_path):
    line = refused(capsys, tmp_path, "data.train_path=/nonexistent.jsonl")
    assert line.startswith("data error: data.train_path=/nonexistent.jsonl: no such file"), line


def test_unknown_builtin_task(capsys, tmp_path):
    line = refused(capsys, tmp_path, "data.train_path=task:no_such_task")
    assert "unknown built-in task" in line and "task:digit_sum" in line


def test_prompt_file_whose_first_record_does_not_parse(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"\n')
    line = refused(capsys, tmp_path, f"data.train_path={path}")
    assert line.startswith(f"data error: {path}:1: line 1 is not valid JSON"), line


def test_prompt_file_with_another_prompt_key_names_the_setting(capsys, tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    line = refused(capsys, tmp_path, f"data.train_path={path}")
    assert "neither 'prompt' nor 'messages'" in line and "set data.prompt_key=question" in line
    assert main(["validate", DEMO, f"data.train_path={path}", "data.prompt_key=question"]) == 0


@pytest.mark.parametrize("spec,words", [
    ("no_such_fn", "unknown reward function"),
    ("no_such_module_xyz:score", "cannot import module"),
    ("megatron_rl.rewards.math_answer:no_such_function", "has no attribute"),
])
def test_reward_that_does_not_resolve(capsys, tmp_path, spec, words):
    line = refused(capsys, tmp_path, f"reward.fn={spec}")
    assert line.startswith(f"reward error: reward.fn={spec}: ") and words in line, line


def test_tokenizer_directory_that_does_not_exist(capsys, tmp_path):
    line = refused(capsys, tmp_path, f"data.tokenizer={tmp_path}/no_tokenizer")
    assert line.startswith(f"data error: data.tokenizer={tmp_path}/no_tokenizer"), line


def test_tokenizer_vocabulary_larger_than_the_model(capsys, tmp_path):
    line = refused(capsys, tmp_path, "model.vocab_size=10")
    assert line.startswith("config error: model.vocab_size=10: smaller than the tokenizer's vocabulary"), line


@pytest.mark.parametrize("key,what", [("model.hf_path", "no config.json"), ("critic.hf_path", "no such directory"),
                                      ("actor.init_checkpoint", "no such directory")])
def test_model_directory_that_does_not_exist(capsys, tmp_path, key, what):
    line = refused(capsys, tmp_path, f"{key}={tmp_path}/missing")
    assert line.startswith(f"config error: {key}={tmp_path}/missing: {what}"), line


def test_train_refuses_before_starting_any_process(tmp_path):
    """The launcher validates before it starts ranks: a bad value never reaches a process group."""
    proc = run_cli("train", "--config", DEMO, "--nproc", "4", f"run.dir={tmp_path}", "rollout.temperature=-1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: rollout.temperature=-1.0: out of range (must be >= 0 and <= 3e+38); "
        "fix: set rollout.temperature to a value >= 0 and <= 3e+38"]
    assert not list(tmp_path.iterdir())


def test_te_dependent_rules_read_the_resolved_implementation(monkeypatch):
    """With ``auto`` the a2a CP rules ask what auto resolves to on this machine, not the literal:
    the local path replicates K/V heads (2 KV heads over cp=4), TransformerEngine does not."""
    cfg = load_config(DEMO, ["parallel.cp=4", "parallel.tp=1", "parallel.pp=1", "parallel.cp_comm_type=a2a",
                             "model.transformer_impl=auto", "batch.packing=false"])
    validate(cfg, 4)  # local path: 4 heads split over cp=4, 2 KV heads replicated
    import megatron_rl.capabilities as capabilities
    import megatron_rl.features.base as features

    def resolves_to_te(requested):
        return "transformer_engine"

    monkeypatch.setattr(features, "resolve_transformer_impl", resolves_to_te)
    monkeypatch.setattr(capabilities, "resolve_transformer_impl", resolves_to_te)
    with pytest.raises(ConfigError, match="TransformerEngine needs"):
        validate(cfg, 4)


def test_a2a_heads_must_split_over_the_a2a_group():
    """4 heads cannot split over cp=8 (nor 3 KV heads be replicated over 2): refused before launch."""
    cfg = load_config(DEMO, ["parallel.cp=8", "parallel.tp=1", "parallel.pp=1", "parallel.cp_comm_type=a2a",
                             "model.transformer_impl=local", "batch.packing=false"])
    with pytest.raises(ConfigError, match=r"parallel.cp=8: a2a splits each TP rank's heads"):
        validate(cfg, 8)
    validate(load_config(DEMO, ["parallel.cp=8", "parallel.tp=1", "parallel.pp=1", "parallel.cp_comm_type=p2p",
                                "model.transformer_impl=local", "batch.packing=false"]), 8)


def test_config_layer_does_not_import_megatron_core():
    """Validation runs on the launcher before any rank: it must not pay for (or depend on) megatron-core."""
    code = ("import sys, megatron_rl.validation, megatron_rl.config.loader; "
            "bad = sorted(m for m in sys.modules if m == 'megatron' or m.startswith(('megatron.', "
            "'megatron_rl.models.'))); print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("overrides,starts", [
    (["model.num_attention_heads=4", "model.num_query_groups=3"], "config error: model.num_query_groups=3: "),
    (["run.name=../../escape"], "config error: run.name=../../escape: is not a plain directory name"),
    (["run.name=.."], "config error: run.name=..: "),
    (["rollout.temperature=inf"], "config error: rollout.temperature=inf: not a finite number"),
    (["actor.optim.lr=inf"], "config error: actor.optim.lr=inf: not a finite number"),
    (["critic.optim.lr=nan"], "config error: critic.optim.lr=nan: not a finite number"),
    (["trainer.steps=0"], "config error: trainer.steps=0: out of range (must be >= 1 and <= 99999999)"),
    (["reward.kwargs=[1,2]"], "config error: reward.kwargs=[1,2]: wrong type, expected a mapping"),
], ids=["heads-not-multiple-of-kv-heads", "run-name-escapes", "run-name-dotdot", "temperature-inf", "lr-inf",
        "lr-nan", "no-steps", "kwargs-list"])
def test_values_that_used_to_pass_or_crash_are_refused(capsys, tmp_path, overrides, starts):
    line = refused(capsys, tmp_path, *overrides)
    assert line.startswith(starts), line


def test_string_override_outside_the_basic_multilingual_plane_is_kept(capsys, tmp_path):
    cfg = load_config(DEMO, ["run.name=caf\U0001F600", "reward.kwargs={tag: \U0001F600}"])
    assert cfg.run.name == "caf\U0001F600" and cfg.reward.kwargs == {"tag": "\U0001F600"}


def test_prompt_file_that_is_not_utf8_names_the_line(capsys, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9 1+1=", "answer": "2"}\n')
    # The loader names the line (the check before launch parses every line the same way).
    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.data.tokenizer import load_tokenizer

    with pytest.raises(Exception) as info:
        load_prompts(str(path), load_tokenizer("char"), max_prompt_tokens=16)
    assert str(info.value).startswith(f"data error: {path}:2: line 2 is not UTF-8 (byte 0xe9"), info.value
    path.write_bytes(b'{"prompt": "caf\xe9 1+1=", "answer": "2"}\n')
    line = refused(capsys, tmp_path, f"data.train_path={path}")
    assert line.startswith(f"data error: {path}:1: line 1 is not UTF-8"), line


def test_parquet_file_with_a_jsonl_name_says_to_rename_it(capsys, tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "prompts.jsonl"
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), str(path))
    line = refused(capsys, tmp_path, f"data.train_path={path}")
    assert "is a Parquet file with a JSON-lines name" in line and "rename it to end in .parquet" in line, line


def _exits(prompts, responses, answers, **kwargs):
    import sys

    sys.exit(3)


def test_reward_that_calls_sys_exit_is_a_reward_error_not_an_exit():
    from megatron_rl.rewards.registry import grade_batch

    with pytest.raises(Exception) as info:
        grade_batch(_exits, ["1+1="], ["2"], ["2"])
    assert not isinstance(info.value, SystemExit)
    assert str(info.value).startswith("reward error: reward.fn=") and "called sys.exit(3)" in str(info.value)


def test_virtual_pipeline_with_too_few_sequences_per_pass_is_refused(capsys, tmp_path):
    line = refused(capsys, tmp_path, "parallel.tp=1", "parallel.pp=2", "parallel.sequence_parallel=false",
                   "parallel.vpp=2", "trainer.prompts_per_step=1", world=2)
    assert line.startswith("config error: trainer.prompts_per_step=1: with virtual pipeline stages a training pass "
                           "needs at least 2*pp micro-batches"), line


MEGATRON = "rollout.engine=megatron"
MOE = ["model.moe.num_experts=4", "model.moe.router_topk=2"]
# rollout.layout on demo_cpu.yaml (TP2 x PP2, 4 heads, 2 KV heads, 4 layers, 64 -> 256 vocabulary rows).
ROLLOUT_LAYOUT_REFUSALS = [
    (4, ["rollout.layout.tp=2", "rollout.layout.pp=4", MEGATRON], "rollout.layout.tp=2",
     "rollout.layout tp*pp=2x4 does not divide the world size 4"),
    (4, ["rollout.layout.tp=1", "rollout.layout.pp=2", "rollout.layout.etp=4", MEGATRON], "rollout.layout.ep=1",
     "rollout.layout etp*ep*pp does not divide the world size 4"),
    (8, ["rollout.layout.tp=8", "rollout.layout.pp=1", MEGATRON], "rollout.layout.tp=8",
     "model.num_attention_heads=4 is not divisible by rollout.layout.tp"),
    (4, ["rollout.layout.tp=4", "rollout.layout.pp=1", MEGATRON], "rollout.layout.tp=4",
     "KV heads (model.num_query_groups=2) are not divisible by rollout.layout.tp"),
    # 66 tokens at make_vocab_size_divisible_by=1 and parallel.tp=2: 66 rows, which TP4 does not split
    (4, ["model.num_query_groups=4", "model.vocab_size=66", "model.make_vocab_size_divisible_by=1",
         "rollout.layout.tp=4", "rollout.layout.pp=1", MEGATRON], "rollout.layout.tp=4",
     "rollout.layout.tp does not divide the training model's padded vocabulary rows (parallel.tp=2)"),
    (4, ["model.num_layers=6", "rollout.layout.tp=1", "rollout.layout.pp=4", MEGATRON], "rollout.layout.pp=4",
     "model.num_layers=6 is not divisible by rollout.layout.pp"),
    (4, ["rollout.layout.tp=1", "rollout.layout.pp=2", "rollout.layout.ep=2", MEGATRON], "rollout.layout.ep=2",
     "rollout.layout.ep must divide the experts of an MoE model"),
    # The planner's rules that validation also needs: 258 hidden units split over TP2, not TP4.
    (4, ["model.num_query_groups=4", "model.ffn_hidden_size=258", "rollout.layout.tp=4", "rollout.layout.pp=1",
         MEGATRON], "rollout.layout.tp=4", "model.ffn_hidden_size=258 is not divisible by rollout.layout.tp"),
    (4, [*MOE, "model.moe.ffn_hidden_size=66", "rollout.layout.tp=1", "rollout.layout.pp=1",
         "rollout.layout.etp=4", MEGATRON], "rollout.layout.etp=4",
     "an expert's hidden units (model.moe.ffn_hidden_size=66) are not divisible by rollout.layout.etp"),
    (4, [*MOE, "rollout.layout.tp=1", "rollout.layout.pp=2", "rollout.layout.ep=2", "rollout.layout.etp=1",
         MEGATRON], "rollout.layout.ep=2", "megatron's engine generates on a model of its own with "
     "rollout.layout.ep > 1 only when rollout.layout.pp is 1"),
]


@pytest.mark.parametrize("world,overrides,key,problem", ROLLOUT_LAYOUT_REFUSALS)
def test_rollout_layout_is_refused_before_launch(capsys, tmp_path, world, overrides, key, problem):
    line = refused(capsys, tmp_path, *overrides, world=world)
    assert line.startswith(f"config error: {key}: {problem}"), line
    assert "; fix: " in line, line


def test_rollout_layout_of_its_own_refuses_routing_replay(capsys, tmp_path):
    moe = ["model.moe.num_experts=4", "model.moe.router_topk=2", "algorithm.routing_replay=true", MEGATRON]
    line = refused(capsys, tmp_path, *moe, "rollout.layout.tp=1", "rollout.layout.pp=2", "rollout.layout.etp=1")
    assert line.startswith("config error: algorithm.routing_replay=True: routing replay records the experts on the "
                           "actor's own shards"), line
    assert "fix: set algorithm.routing_replay=false, or leave rollout.layout unset" in line
    # The training layout's sizes share the actor's shards: routing replay is fine there.
    assert main(["validate", DEMO, "--world-size", "4", f"run.dir={tmp_path}/runs", *moe]) == 0
    assert main(["validate", DEMO, "--world-size", "4", f"run.dir={tmp_path}/runs", MEGATRON, "rollout.layout.tp=1",
                 "rollout.layout.pp=2"]) == 0
