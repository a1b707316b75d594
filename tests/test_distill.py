"""On-policy distillation: the advantage by hand, teachers matched by data_source, teacher log-probs
against HF transformers on every layout, a distillation step on every layout against one process,
vocabularies refused before launch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms.distill import distill_advantages, reverse_kl
from megatron_rl.testing.harness import run_distributed
from tests.support.helpers import make_hf_model, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_TOL = 1e-4
LAYOUT_TOL = 1e-5
# A student the HF teachers below fit (same vocabulary size), tiny.
STUDENT = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
           "model.num_query_groups=2", "model.vocab_size=250", "model.max_position_embeddings=64"]


def test_the_advantage_is_teacher_minus_student_on_policy_tokens_plus_the_weighted_task_advantage():
    """Row 0 is a multi-turn trajectory: its second token is an observation (mask 0) and gets nothing."""
    student = torch.tensor([[-0.5, -2.0, -1.0], [-3.0, -0.1, 0.0]])
    teacher = torch.tensor([[-0.1, -9.0, -4.0], [-1.0, -0.2, -7.0]])
    task = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    got = distill_advantages(task, student, teacher, mask, coef=2.0, reward_coef=0.25)
    want = torch.zeros(2, 3)
    for i in range(2):
        for j in range(3):
            if mask[i, j]:
                want[i, j] = 2.0 * (float(teacher[i, j]) - float(student[i, j])) + 0.25 * float(task[i, j])
    assert torch.equal(got, want) and got[0, 1] == 0 and got[1, 2] == 0
    on = [(i, j) for i in range(2) for j in range(3) if mask[i, j]]
    by_hand = sum(float(student[i, j] - teacher[i, j]) for i, j in on) / len(on)
    assert reverse_kl(student, teacher, mask) == pytest.approx(by_hand, rel=1e-6)


def test_each_sample_goes_to_its_sources_teacher_and_a_source_without_one_is_refused():
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.prompts import PromptSet
    from megatron_rl.errors import ConfigError
    from megatron_rl.trainer.experience import Samples
    from megatron_rl.trainer.teacher_rows import TeacherRows
    from megatron_rl.trainer.teachers import TeacherSource

    def prompts(sources):
        return PromptSet([[1]] * len(sources), ["p"] * len(sources), [None] * len(sources),
                         list(range(1, len(sources) + 1)), path="data.jsonl",
                         fields=[{"data_source": s} if s else {} for s in sources])

    def teacher(name):
        return TeacherSource(name, f"/t/{name}", "hf", ModelConfig())

    samples = Samples(prompt_index=[0, 0, 1, 2], dataset_index=[0, 0, 1, 2], prompt_ids=[[1]] * 4,
                      response_ids=[[2]] * 4, rollout_logprob=[[0.0]] * 4, finish_reason=["stop"] * 4)
    rows = TeacherRows((teacher("math"), teacher("default")), prompts(["math", "code", None]))
    assert rows.of(samples) == {"math": [0, 1], "default": [2, 3]}
    with pytest.raises(ConfigError, match=r"prompt 2 of data.jsonl has data_source='code', which no teacher scores"):
        TeacherRows((teacher("math"),), prompts(["math", "code"]))
    assert TeacherRows((), prompts(["x"])).of(samples) == {}


# ----------------------------------------------------------------------------- teacher log-probs == HF


def teacher_scores_body(hf_dir: str, layout_kw: dict, sequences: list[list[int]], prompt_len: int) -> list:
    """The trainer's teacher pass (:func:`teacher_logprobs`) on this layout: the teacher's log-prob of
    every token after the first ``prompt_len`` of each sequence."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.engine.forward import batch_plan
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.trainer.experience import Samples
    from megatron_rl.trainer.experience_pass import teacher_logprobs
    from megatron_rl.trainer.model_set import ModelSet, build_teachers
    from megatron_rl.trainer.teachers import read_teachers

    cfg = load_config(None, STUDENT + ["rollout.temperature=1.0"])
    layout = use_layout(**layout_kw)
    sources = read_teachers({"default": hf_dir}, cfg.model)
    models = ModelSet(None, None, None, batch_plan(cfg.batch, layout, 4096), torch.device("cpu"),
                      teachers=build_teachers(sources, layout, torch.device("cpu")), teacher_sources=sources)
    n = len(sequences)
    samples = Samples(prompt_index=list(range(n)), dataset_index=list(range(n)),
                      prompt_ids=[s[:prompt_len] for s in sequences], response_ids=[s[prompt_len:] for s in sequences],
                      rollout_logprob=[[0.0] * (len(s) - prompt_len) for s in sequences], finish_reason=["stop"] * n)
    return teacher_logprobs(models, samples, {"default": list(range(n))}, cfg, {}).tolist()


TEACHER_LAYOUTS = {
    "one_process": (1, {}),
    "tp2_sp": (2, {"tp": 2, "sp": True}),
    "pp2": (2, {"pp": 2}),
    "cp2": (2, {"cp": 2}),
    "dp2": (2, {}),
    "tp2_pp2": (4, {"tp": 2, "pp": 2}),
    "tp2_cp2_sp": (4, {"tp": 2, "cp": 2, "sp": True}),
}


@pytest.fixture(scope="module")
def hf_teacher(tmp_path_factory):
    """A Qwen2 teacher (bigger than the student: 4 layers, hidden 64) and sequences of varied length."""
    from tests.support.helpers import hf_logprobs

    path = str(tmp_path_factory.mktemp("teacher"))
    model = make_hf_model("qwen2", path, seed=3)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (9, 17, 12, 30)]
    prompt_len = 5
    reference = [hf_logprobs(model, s)[prompt_len - 1:].tolist() for s in sequences]
    return path, sequences, prompt_len, reference


@pytest.mark.parametrize("layout", list(TEACHER_LAYOUTS))
def test_teacher_logprobs_equal_hf_transformers_on_every_layout(hf_teacher, layout):
    path, sequences, prompt_len, reference = hf_teacher
    world, layout_kw = TEACHER_LAYOUTS[layout]
    rows = run_distributed(world, teacher_scores_body, path, layout_kw, sequences, prompt_len)[0]
    worst = max(abs(a - b) for row, ref in zip(rows, reference) for a, b in zip(row, ref))
    padding = [v for row, ref in zip(rows, reference) for v in row[len(ref):]]
    print(f"{layout}: teacher log-probs vs HF, worst {worst:.2e}")
    assert worst <= HF_TOL and all(v == 0.0 for v in padding)


# ----------------------------------------------------------------------------- a distillation step on every layout


TINY_RUN = STUDENT[:-2] + ["model.vocab_size=64", "model.max_position_embeddings=64", "data.train_path=task:add_small",
                           "data.tokenizer=char", "data.max_prompt_tokens=16", "rollout.n=2",
                           "rollout.max_new_tokens=3",
                           "reward.fn=digit_sum", "algorithm.advantage=grpo", "algorithm.kl_coef=0.0",
                           "trainer.prompts_per_step=4", "trainer.plot=false", "trainer.resume=never"]


@pytest.fixture(scope="module")
def trained_teacher(tmp_path_factory) -> str:
    """A teacher trained by the project (a warm-up and one step of a wider model on the task): its run
    directory."""
    from tests.support.helpers import train_body

    where = tmp_path_factory.mktemp("teacher_run")
    teacher = TINY_RUN + ["model.hidden_size=48", "model.ffn_hidden_size=96",
                          "trainer.sft_warmup_steps=4", "trainer.steps=1", f"run.dir={where}", "run.name=teacher",
                          "run.seed=5"]
    run_distributed(1, train_body, None, teacher)
    return str(where / "teacher")


DISTILL_LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
    "cp2": ["parallel.cp=2"],
    "dp2": [],
}
# What a layout may change: timing, memory, weights' size per rank.
VOLATILE = ("timing/", "throughput/", "memory/", "rollout/weights_gb")


def _numbers(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and isinstance(v, (int, float))} for r in rows]


@pytest.mark.slow
def test_distillation_steps_on_every_layout_equal_one_process(trained_teacher, tmp_path):
    """Two steps of distillation plus the task advantage (reward_coef 0.5), teacher and student on
    TP2+SP, PP2, CP2 and DP2, against one process: every metric (reverse KL, losses, gradient norm,
    rewards) within 1e-5 relative."""
    from tests.support.helpers import train_body

    teacher = trained_teacher
    # Greedy: DP replicas batch sequences differently, which can flip a temperature draw that lies on a
    # boundary; greedy samples are the same on every layout, so the steps train on the same tokens.
    common = TINY_RUN + [f"algorithm.distill.teachers={{default: {teacher}}}", "algorithm.distill.reward_coef=0.5",
                         "rollout.temperature=0", "trainer.steps=2", f"run.dir={tmp_path}"]
    run_distributed(1, train_body, None, common + ["run.name=one"])
    want = _numbers(read_metrics(tmp_path / "one"))
    assert want[0]["distill/reverse_kl"] > 0.01  # the teacher is another model
    worst = {}
    for name, overrides in DISTILL_LAYOUTS.items():
        run_distributed(2, train_body, None, common + overrides + [f"run.name={name}"])
        got = _numbers(read_metrics(tmp_path / name))
        assert [sorted(r) for r in got] == [sorted(r) for r in want]
        worst[name] = max(abs(g[k] - w[k]) / max(1.0, abs(w[k])) for g, w in zip(got, want) for k in w)
    print("distillation metrics vs one process, worst relative difference:", worst)
    assert max(worst.values()) <= LAYOUT_TOL


# ----------------------------------------------------------------------------- refused before launch


def test_a_teacher_of_another_vocabulary_or_without_one_is_refused_before_launch(tmp_path):
    from megatron_rl.config.loader import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.tools.preflight import check_training_inputs

    hf_dir = tmp_path / "no_tokenizer"
    make_hf_model("llama", str(hf_dir))
    base = TINY_RUN + [f"run.dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"algorithm.distill.teachers.default=.*no_tokenizer: records no vocabulary"):
        check_training_inputs(load_config(None, base + [f"algorithm.distill.teachers={{default: {hf_dir}}}"]))
    # A checkpoint teacher trained with another character alphabet: same size, other tokens.
    step = tmp_path / "other" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 1}))
    with pytest.raises(ConfigError, match="not a usable checkpoint"):
        check_training_inputs(load_config(None, base + [f"algorithm.distill.teachers={{default: {step}}}"]))
    with pytest.raises(ConfigError, match="no such directory"):
        check_training_inputs(load_config(None, base + ["algorithm.distill.teachers={math: /nonexistent}"]))


def test_a_teacher_checkpoint_records_its_vocabulary_and_another_one_is_refused(trained_teacher):
    from megatron_rl.config.loader import load_config
    from megatron_rl.data.tokenizer import load_tokenizer, vocabulary_digest
    from megatron_rl.errors import ConfigError
    from megatron_rl.tools.preflight import check_training_inputs

    teacher = trained_teacher
    meta = json.loads(next(Path(teacher, "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["vocabulary"] == vocabulary_digest(load_tokenizer("char"))
    ok = TINY_RUN + [f"algorithm.distill.teachers={{default: {teacher}}}"]
    check_training_inputs(load_config(None, ok))
    other = ok + ["data.tokenizer=char:0123456789+=abcdefghijklmnopqrstuvwxyz!"]
    with pytest.raises(ConfigError, match=r"its vocabulary \(\d+ tokens\) is not the student's"):
        check_training_inputs(load_config(None, other))


@pytest.mark.slow
def test_distillation_runs_on_a_generator_rank_in_async_mode(trained_teacher, tmp_path):
    """One generator rank and one trainer rank (the job a user starts), batches up to one version
    stale: the trainer scores the generated tokens with the teacher as it does colocated."""
    from megatron_rl.testing.cli_runner import run_cli

    teacher = trained_teacher
    proc = run_cli("train", "--nproc", "2", *TINY_RUN, f"algorithm.distill.teachers={{default: {teacher}}}",
                   "rollout.ranks=1", "trainer.mode=async", "trainer.max_staleness=1", "trainer.steps=3",
                   f"run.dir={tmp_path}", "run.name=async", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "async")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["distill/reverse_kl"] > 0 for r in rows) and rows[-1]["rollout/staleness_max"] == 1
