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
    # batch_mean: the mean of teacher - student over the on-policy tokens is subtracted first.
    on = [(i, j) for i in range(2) for j in range(3) if mask[i, j]]
    mean_gap = sum(float(teacher[i, j] - student[i, j]) for i, j in on) / len(on)
    got = distill_advantages(task, student, teacher, mask, coef=2.0, reward_coef=0.25, baseline="batch_mean")
    for i, j in on:
        want[i, j] = 2.0 * (float(teacher[i, j] - student[i, j]) - mean_gap) + 0.25 * float(task[i, j])
    assert torch.allclose(got, want, atol=1e-6) and got[0, 1] == 0 and got[1, 2] == 0
    by_hand = sum(float(student[i, j] - teacher[i, j]) for i, j in on) / len(on)
    assert reverse_kl(student, teacher, mask) == pytest.approx(by_hand, rel=1e-6)


def test_each_sample_goes_to_its_sources_teacher_and_a_source_without_one_is_refused():
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.prompts import PromptSet
    from megatron_rl.engine.teachers import TeacherSource
    from megatron_rl.errors import ConfigError
    from megatron_rl.trainer.experience import Samples
    from megatron_rl.trainer.teacher_rows import TeacherRows

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


def teacher_scores_body(hf_dir: str, layout_kw: dict, sequences: list[list[int]], prompt_len: int,
                        own_kw: dict | None = None) -> list:
    """The trainer's teacher pass (:func:`teacher_logprobs`) on this layout (the teacher on a layout
    of its own with ``own_kw``): the teacher's log-prob of every token after the first ``prompt_len``
    of each sequence."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.engine.forward import batch_plan
    from megatron_rl.engine.teachers import read_teachers
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.trainer.experience import Samples
    from megatron_rl.trainer.experience_pass import teacher_logprobs
    from megatron_rl.trainer.model_set import ModelSet, build_teachers

    cfg = load_config(None, STUDENT + ["rollout.temperature=1.0"])
    layout = use_layout(**layout_kw)
    sources = read_teachers({"default": hf_dir}, cfg.model)
    own = groups = None
    if own_kw:
        import torch.distributed as dist

        from megatron_rl.layout.sizes import ParallelLayout
        from megatron_rl.trainer.model_set import teacher_groups

        tp, pp, cp = own_kw.get("tp", 1), own_kw.get("pp", 1), own_kw.get("cp", 1)
        own = ParallelLayout(tp=tp, pp=pp, cp=cp, dp=dist.get_world_size() // (tp * pp * cp),
                             sequence_parallel=own_kw.get("sp", False))
        groups = teacher_groups(own)
    models = ModelSet(None, None, None, batch_plan(cfg.batch, layout, 4096), torch.device("cpu"),
                      teachers=build_teachers(sources, layout, torch.device("cpu"), own), teacher_sources=sources,
                      teacher_layout=own, teacher_groups=groups)
    if own is not None:  # the teacher is sharded as its own layout says, not as the training one
        from megatron_rl.layout.arch import attention_dims
        from megatron_rl.models.canonical import unwrap

        model, chunk = sources[0].model, unwrap(models.teachers["default"][0])
        heads, kv_heads, head_dim = attention_dims(model)
        assert len(chunk.decoder.layers) == model.num_layers // own.pp
        assert chunk.decoder.layers[0].self_attention.linear_qkv.weight.shape[0] * own.tp == \
            (heads + 2 * kv_heads) * head_dim
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


# The teacher on a layout of its own: (world, the training layout, the teacher's).
OWN_TEACHER_LAYOUTS = {
    "train_dp2_teacher_tp2_sp": (2, {}, {"tp": 2, "sp": True}),
    "train_tp2_teacher_pp2": (2, {"tp": 2, "sp": True}, {"pp": 2}),
    "train_pp2_teacher_tp2": (2, {"pp": 2}, {"tp": 2}),
    "train_cp2_teacher_tp2": (2, {"cp": 2}, {"tp": 2}),
    "train_tp2_teacher_cp2": (2, {"tp": 2}, {"cp": 2}),
    "train_dp4_teacher_tp2_pp2": (4, {}, {"tp": 2, "pp": 2}),
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


@pytest.mark.parametrize("layout", list(OWN_TEACHER_LAYOUTS))
def test_a_teacher_on_a_layout_of_its_own_scores_as_hf_transformers(hf_teacher, layout):
    """algorithm.distill.layout: the teacher built, loaded and run with process groups of its own
    beside the training layout's (its shards are its layout's: layers per stage, heads per TP rank);
    its log-probs == HF's on every rank."""
    path, sequences, prompt_len, reference = hf_teacher
    world, layout_kw, own_kw = OWN_TEACHER_LAYOUTS[layout]
    ranks = run_distributed(world, teacher_scores_body, path, layout_kw, sequences, prompt_len, own_kw)
    worst = max(abs(a - b) for rows in ranks for row, ref in zip(rows, reference) for a, b in zip(row, ref))
    print(f"{layout}: teacher log-probs vs HF, worst {worst:.2e}")
    assert worst <= HF_TOL


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
    # The teacher (a checkpoint) on a layout of its own beside the student's (offloaded between phases).
    "dp2_teacher_tp2": ["algorithm.distill.layout.tp=2", "trainer.offload=true"],
    "tp2_sp_teacher_pp2": ["parallel.tp=2", "parallel.sequence_parallel=true", "algorithm.distill.layout.tp=1",
                           "algorithm.distill.layout.pp=2"],
}
# What a layout may change: timing, memory, weights' size per rank.
VOLATILE = ("timing/", "throughput/", "memory/", "rollout/weights_gb")


def _numbers(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and isinstance(v, (int, float))} for r in rows]


@pytest.mark.slow
def test_distillation_steps_on_every_layout_equal_one_process(trained_teacher, tmp_path):
    """Two steps of distillation plus the task advantage (reward_coef 0.5), teacher and student on
    TP2+SP, PP2, CP2 and DP2, and the teacher on a layout of its own (TP2 beside DP2 with offload,
    PP2 beside TP2+SP), against one process: every metric (reverse KL, losses, gradient norm, rewards) within
    1e-5 relative."""
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


def test_a_teachers_own_layout_is_refused_where_it_cannot_run(tmp_path):
    """algorithm.distill.layout without a teacher, with sizes that do not divide the training ranks,
    with hierarchical CP, or one the teacher's shape does not take: one line each."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.engine.teachers import check_teacher_layouts, read_teachers
    from megatron_rl.errors import ConfigError
    from megatron_rl.validation import validate

    hf_dir = tmp_path / "teacher"
    make_hf_model("qwen2", str(hf_dir), seed=3)  # 4 heads, 2 KV heads
    teacher = [f"algorithm.distill.teachers={{default: {hf_dir}}}"]
    with pytest.raises(ConfigError, match=r"algorithm.distill.layout=tp=2 pp=1 cp=1: is set, but there is no teacher"):
        validate(load_config(None, TINY_RUN + ["algorithm.distill.layout.tp=2"]), 2)
    with pytest.raises(ConfigError, match=r"layout=tp=1 pp=4 cp=1: tp\*pp\*cp=4 does not divide the 2 training ranks"):
        validate(load_config(None, TINY_RUN + teacher + ["algorithm.distill.layout.pp=4"]), 2)
    hierarchical = ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p",
                    "parallel.hierarchical_context_parallel_sizes=[2,2]", "algorithm.distill.layout.tp=2"]
    with pytest.raises(ConfigError, match=r"does not take hierarchical CP"):
        validate(load_config(None, TINY_RUN + teacher + hierarchical), 8)
    validate(load_config(None, TINY_RUN + teacher + ["algorithm.distill.layout.tp=2"]), 2)
    cfg = load_config(None, STUDENT + teacher + ["algorithm.distill.layout.tp=8"])
    with pytest.raises(ConfigError, match=r"teachers.default=.*: on algorithm.distill.layout \(tp=8 pp=1 cp=1\): "):
        check_teacher_layouts(read_teachers(cfg.algorithm.distill.teachers, cfg.model), cfg)


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
    # Embedding tables padded to other sizes (as Qwen2.5-7B's and 1.5B's are) with one tokenizer: taken.
    check_training_inputs(load_config(None, ok + ["model.vocab_size=72"]))
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


# ----------------------------------------------------------------------------- the teacher's memory, planned


def teacher_weight_bytes_body(hf_dir: str, layout_kw: dict, own_kw: dict | None = None) -> tuple[int, float]:
    """The teacher's weight bytes on this rank as built (on a layout of its own with ``own_kw``), and
    what the planner counts for it."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.engine.teachers import read_teachers
    from megatron_rl.planner.memory import model_state
    from megatron_rl.planner.option import PlanOption
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.trainer.model_set import build_teachers

    cfg = load_config(None, STUDENT)
    layout = use_layout(**layout_kw)
    sources = read_teachers({"default": hf_dir}, cfg.model)
    own = None
    if own_kw:
        from megatron_rl.layout.sizes import ParallelLayout

        own = ParallelLayout(tp=own_kw.get("tp", 1), pp=own_kw.get("pp", 1), dp=1)
    chunks = build_teachers(sources, layout, torch.device("cpu"), own)["default"]
    measured = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    option = PlanOption.of(tp=layout_kw.get("tp", 1), pp=layout_kw.get("pp", 1), dp=1)
    taught = PlanOption.of(tp=own.tp, pp=own.pp, dp=1) if own else None
    planned = model_state(cfg.model, option, False, False, 4, teachers=(sources[0].model,),
                          teacher_layout=taught)["teacher weights"]
    return measured, planned


@pytest.mark.parametrize("layout", ["one_process", "tp2_sp", "pp2", "train_pp2_teacher_tp2"])
def test_the_planner_counts_the_teachers_weights_as_built(hf_teacher, layout):
    """Per rank, the bytes of the teacher's weights as built against the planner's count (fp32 on the
    CPU): within 10% on the most loaded rank (the planner counts that one; it leaves out the norms);
    also with the teacher on a layout of its own."""
    if layout in OWN_TEACHER_LAYOUTS:
        world, layout_kw, own_kw = OWN_TEACHER_LAYOUTS[layout]
    else:
        (world, layout_kw), own_kw = TEACHER_LAYOUTS[layout], None
    rows = run_distributed(world, teacher_weight_bytes_body, hf_teacher[0], layout_kw, own_kw)
    measured, planned = max(m for m, _ in rows), rows[0][1]
    print(f"{layout}: teacher weights per rank measured {measured} B, planned {planned:.0f} B")
    assert abs(measured - planned) <= 0.10 * measured


def test_plan_sizes_the_teacher_and_asks_for_one_it_cannot_read(capsys):
    """``megatron-rl plan --teacher`` adds the teacher's frozen weights and its scoring peak; a
    recipe's teacher directory this machine lacks asks for --teacher in one line."""
    import argparse

    from megatron_rl.errors import ConfigError
    from megatron_rl.planner.memory import params_per_gpu
    from megatron_rl.planner.option import PlanOption
    from megatron_rl.planner.search import preset
    from megatron_rl.tools.plan import add_arguments, run_plan

    def plan(*argv):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        rc = run_plan(parser.parse_args(list(argv)))
        return rc, capsys.readouterr().out

    common = ["--model", "qwen2.5-1.5b", "--prompt-len", "1024", "--response-len", "16384", "--no-critic",
              "--no-reference"]
    rc, alone = plan(*common)
    rc_t, taught = plan(*common, "--teacher", "qwen2.5-7b")
    assert rc == rc_t == 0 and "teacher (7.6B, frozen)" in taught
    line = next(t for t in taught.splitlines() if t.startswith("distillation: teacher weights"))
    tp = int(next(t for t in taught.splitlines() if t.startswith("recommended: ")).split("tp")[1].split()[0])
    gib = params_per_gpu(preset("qwen2.5-7b"), PlanOption.of(tp=tp)) * 2 / 2**30
    assert f"teacher weights {gib:.2f} GiB" in line
    # On a TP4 layout of its own the teacher holds a quarter of its weights per GPU.
    rc_own, own = plan(*common, "--teacher", "qwen2.5-7b", "--teacher-tp", "4")
    gib_own = params_per_gpu(preset("qwen2.5-7b"), PlanOption.of(tp=4)) * 2 / 2**30
    assert rc_own == 0 and f"teacher weights {gib_own:.2f} GiB per GPU on its own layout tp4 pp1 cp1" in own
    # The teacher's memory leaves less for generation: fewer sequences generated together.
    batch = [int(next(t for t in out.splitlines() if t.startswith("recommended: ")).split(", ")[-1].split()[0])
             for out in (alone, taught, own)]
    assert batch[1] < batch[2] <= batch[0]
    with pytest.raises(ConfigError, match=r"--teacher-tp=4: places a teacher, but there is none"):
        plan(*common, "--teacher-tp", "4")
    recipe = os.path.join(ROOT, "configs", "distill_qwen2.5_7b_to_1.5b_16k.yaml")
    from megatron_rl.config.loader import load_config
    from megatron_rl.validation import validate

    validate(load_config(recipe), 8)  # the GPU recipe, teacher layout included, for its 8 GPUs
    with pytest.raises(ConfigError, match=r"teachers.default=/models/Qwen2.5-7B-Instruct: no such directory; "
                                          r"fix: plan for it with --teacher"):
        plan("--model", "qwen2.5-1.5b", "--config", recipe)


# ----------------------------------------------------------------------------- it learns


@pytest.fixture(scope="module")
def digit_sum_teacher(tmp_path_factory) -> tuple[str, float]:
    """configs/distill_teacher_cpu.yaml's teacher, trained by the project: its run directory and reward."""
    from tests.support.helpers import train_body

    where = tmp_path_factory.mktemp("digit_sum_teacher")
    run_distributed(1, train_body, os.path.join(ROOT, "configs", "distill_teacher_cpu.yaml"), [f"run.dir={where}"])
    return str(where / "distill_teacher_cpu"), read_metrics(where / "distill_teacher_cpu")[-1]["reward/mean"]


@pytest.mark.slow
def test_a_distilled_student_gains_reward_faster_than_grpo_alone(digit_sum_teacher, tmp_path):
    """configs/distill_cpu.yaml's student (a 60-step warm-up, far below the teacher), 100 steps,
    distilled from the teacher and with GRPO on the reward alone, the same samples per step: the
    distilled student's reward over the last 20 steps is above GRPO's and 1.3x its own start, and
    the reverse KL to the teacher falls by a third.  Loose bounds; benchmarks/distill_vs_grpo.py
    measures the curves over seeds."""
    from tests.support.helpers import train_body

    teacher, teacher_reward = digit_sum_teacher
    assert teacher_reward > 0.6
    config = os.path.join(ROOT, "configs", "distill_cpu.yaml")
    runs = {"distill": [f"algorithm.distill.teachers={{default: {teacher}}}"],
            "grpo": ["algorithm.distill.teachers={}"]}
    rows = {}
    for name, overrides in runs.items():
        run_distributed(1, train_body, config, overrides + [f"run.dir={tmp_path}", f"run.name={name}"])
        rows[name] = read_metrics(tmp_path / name)
    reward = {name: [r["reward/mean"] for r in got] for name, got in rows.items()}
    late = {name: sum(r[-20:]) / 20 for name, r in reward.items()}
    kl = [r["distill/reverse_kl"] for r in rows["distill"]]
    start = sum(reward["distill"][:5]) / 5
    print(f"teacher {teacher_reward:.3f}; reward over the last 20 steps {late}; start {start:.3f}; "
          f"reverse KL {sum(kl[:5]) / 5:.3f} -> {sum(kl[-5:]) / 5:.3f}")
    assert "distill/reverse_kl" not in rows["grpo"][0]
    assert late["distill"] > late["grpo"]
    assert late["distill"] > 1.3 * start
    assert sum(kl[-5:]) / 5 < 0.67 * sum(kl[:5]) / 5
