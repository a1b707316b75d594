"""The evaluation set during training: its metrics equal an independent computation, do not depend
on the data-parallel size (greedy), keep their schedule across a resume, leave training alone, and
a bad evaluation file stops the run before launch."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from megatron_rl.testing.harness import run_distributed
from megatron_rl.tools.cli import main
from megatron_rl.trainer.evaluation import evaluation_metrics, pass_at_k, pass_ks
from tests.support.helpers import TINY, digit_share, ppo_body, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Held-out prompts of another task than TINY's add_small; a threshold a random tiny model reaches on
# some prompts (one digit in three tokens), so accuracy is neither 0 nor 1.
EVAL = ["data.val_path=task:digit_sum", "eval.max_prompts=12", "trainer.eval_every=2", "eval.correct_threshold=0.3"]
# At the default init scale this tiny model answers every prompt alike; at 0.2 its greedy answers differ.
SPREAD = ["model.init_method_std=0.2"]


# ----------------------------------------------------------------------------- the numbers


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample():
    for n in (1, 2, 3, 5):
        for correct in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([True] * correct + [False] * (n - correct), k))
                assert pass_at_k(n, correct, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_ks(1) == [] and pass_ks(2) == [2] and pass_ks(4) == [2, 4] and pass_ks(6) == [2, 4, 6]


def test_evaluation_metrics_of_a_known_batch():
    # Two prompts, three samples each: prompt 0 has one correct sample, prompt 1 none.
    scores = torch.tensor([0.0, 1.0, 0.1, 0.1, 0.0, -1.0])
    out = evaluation_metrics(scores, [3, 4, 5, 1, 1, 4], n=3, threshold=0.5)
    assert out["eval/reward_mean"] == pytest.approx(0.2 / 6)
    assert out["eval/accuracy"] == pytest.approx(1 / 6)
    assert out["eval/response_len"] == pytest.approx(3.0)
    assert out["eval/prompts"] == 2
    assert out["eval/pass@2"] == pytest.approx((2 / 3 + 0) / 2)  # 2 of the 3 pairs of prompt 0 hold it
    assert out["eval/pass@3"] == pytest.approx(0.5)


def test_metrics_writer_sends_the_step_zero_evaluation_to_tensorboard_and_the_plot(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rl.trainer.metrics import MetricsWriter, plot_metrics

    writer = MetricsWriter(str(tmp_path), True, 4, tensorboard=True)
    writer.log(0, {"eval/reward_mean": 0.25, "eval/accuracy": 0.5})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = sorted((tag, e.value, e.step) for tag in events.Tags()["scalars"] for e in events.Scalars(tag))
    assert scalars == [("eval/accuracy", 0.5, 0), ("eval/reward_mean", 0.25, 0)]
    # A run stopped after its first evaluation has only that to plot.
    pytest.importorskip("matplotlib")
    assert plot_metrics(writer.path, str(tmp_path / "plot.png")) == str(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


# ----------------------------------------------------------------------------- against greedy generation


def greedy_reference(trainer) -> dict:
    """The evaluation recomputed without the rollout engine: for each prompt, the argmax of the
    actor's full forward over the whole prefix (its hidden states times the output weights), token
    by token, until a stop token or the budget; graded by the test's own reward function."""
    model, vocab = trainer.actor.chunks[0].module, trainer.cfg.model.vocab_size  # inside megatron's DDP
    stops, budget = set(trainer.evaluator.sampling.stop_token_ids), trainer.cfg.eval.max_new_tokens
    prompts = trainer.evaluator.prompts
    responses = []
    with torch.no_grad():
        for ids in prompts.prompt_ids:
            seq = list(ids)
            while len(seq) - len(ids) < budget and (len(seq) == len(ids) or seq[-1] not in stops):
                hidden = model(torch.tensor([seq]), torch.arange(len(seq))[None], None)  # [s, 1, h]
                logits = hidden[-1, 0] @ model.output_weight().T
                seq.append(int(logits[:vocab].argmax()))
            responses.append(seq[len(ids):])
    rewards = torch.tensor(digit_share(prompts.prompts, [trainer.tokenizer.decode(r) for r in responses],
                                       prompts.answers))
    return {"eval/reward_mean": float(rewards.mean()),
            "eval/accuracy": float((rewards >= trainer.cfg.eval.correct_threshold).float().mean()),
            "eval/response_len": sum(map(len, responses)) / len(responses), "eval/prompts": len(responses)}


def eval_body(overrides: list[str], train_one_step: bool):
    """Evaluate the freshly built actor (and, with ``train_one_step``, again after one PPO step);
    on one process also the independent greedy reference of each."""
    import torch.distributed as dist

    from megatron_rl.config.loader import load_config
    from megatron_rl.trainer.ppo import PPOTrainer
    from megatron_rl.validation import validate

    cfg = load_config(None, TINY + SPREAD + EVAL + ["trainer.resume=never"] + overrides)
    validate(cfg, dist.get_world_size())
    trainer = PPOTrainer(cfg, log=lambda line: None)
    one = dist.get_world_size() == 1
    out = {"before": trainer.evaluator.run(0), "reference_before": greedy_reference(trainer) if one else None}
    if train_one_step:
        trainer.train_step(1)
        out.update(after=trainer.evaluator.run(1), reference_after=greedy_reference(trainer) if one else None)
    return out


def _eval_figures(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("eval/")}


def test_greedy_evaluation_is_the_reward_of_greedy_generation(tmp_path):
    out = run_distributed(1, eval_body, [f"run.dir={tmp_path}", "run.name=g"], True)[0]
    print("before:", _eval_figures(out["before"]), "after one step:", _eval_figures(out["after"]))
    for when in ("before", "after"):
        got, want = out[when], out[f"reference_{when}"]
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-6), (when, key)
        assert got["eval/reward_timeouts"] == 0 and "eval/pass@2" not in got  # n = 1
    # The figures say something: some prompts pass, not all; and the step moved the policy.
    assert 0 < out["before"]["eval/accuracy"] < 1
    assert out["reference_before"] != out["reference_after"]


@pytest.mark.slow
def test_greedy_evaluation_does_not_depend_on_the_data_parallel_size(tmp_path):
    one = run_distributed(1, eval_body, [f"run.dir={tmp_path}", "run.name=one"], False)[0]["before"]
    two = run_distributed(2, eval_body, [f"run.dir={tmp_path}", "run.name=two"], False)  # dp = 2: 6 prompts each
    assert _eval_figures(two[0]["before"]) == _eval_figures(two[1]["before"])
    assert _eval_figures(two[0]["before"]) == _eval_figures(one)
    assert 0 < one["eval/accuracy"] < 1


# ----------------------------------------------------------------------------- schedule and resume

VOLATILE = ("timing/", "throughput/", "memory/")


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.slow
def test_evaluation_keeps_its_schedule_across_a_resume_and_leaves_training_alone(tmp_path):
    common = SPREAD + ["trainer.save_every=2", f"run.dir={tmp_path}"]
    run_distributed(1, ppo_body, common + EVAL + ["trainer.steps=4", "run.name=straight"])
    run_distributed(1, ppo_body, common + EVAL + ["trainer.steps=2", "run.name=resumed"])
    run_distributed(1, ppo_body, common + EVAL + ["trainer.steps=4", "run.name=resumed"])
    run_distributed(1, ppo_body, common + ["trainer.steps=4", "run.name=without"])
    straight, resumed = _stable(read_metrics(tmp_path / "straight")), _stable(read_metrics(tmp_path / "resumed"))
    without = _stable(read_metrics(tmp_path / "without"))
    # Before the first step, every 2 steps, after the last; the resumed run did not evaluate its
    # start (step 2) again, and step 0 has one record.
    assert [r["step"] for r in straight] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in straight if "eval/reward_mean" in r] == [0, 2, 4]
    assert set(straight[0]) == {"step"} | {k for k in straight[2] if k.startswith("eval/")}
    assert resumed == straight
    # Evaluating draws nothing from the training's random streams: the same training run.
    assert [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in straight[1:]] == without
    assert len({r["eval/reward_mean"] for r in straight if "eval/reward_mean" in r}) > 1


# ----------------------------------------------------------------------------- checked before launch


def _refused(capsys, tmp_path, *overrides: str) -> str:
    """``megatron-rl validate configs/demo_cpu.yaml overrides``: its one stderr line (exit code 2)."""
    code = main(["validate", os.path.join(ROOT, "configs", "demo_cpu.yaml"), f"run.dir={tmp_path}/runs", *overrides])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert not (tmp_path / "runs").exists()
    return lines[0]


def test_evaluation_file_is_checked_before_launch(capsys, tmp_path):
    on = ["trainer.eval_every=5"]
    missing = tmp_path / "missing.jsonl"
    assert _refused(capsys, tmp_path, f"data.val_path={missing}", *on) == (
        f"data error: data.val_path={missing}: no such file; fix: check the prompt data path (or use task:<name>)")
    assert _refused(capsys, tmp_path, "data.val_path=task:nope", *on).startswith(
        "data error: data.val_path=task:nope: unknown built-in task")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "answer": "2"\n')
    assert _refused(capsys, tmp_path, f"data.val_path={broken}", *on).startswith(
        f"data error: {broken}:1: line 1 is not valid JSON")
    # Read with the training data's keys: a file keyed otherwise names the key to set.
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    line = _refused(capsys, tmp_path, f"data.val_path={questions}", *on)
    assert line.startswith(f"data error: {questions}:1: the record has neither 'prompt' nor 'messages'")
    assert "set data.prompt_key=question" in line
    # The settings themselves.
    assert _refused(capsys, tmp_path, *on).startswith(
        "config error: trainer.eval_every=5: there is no evaluation set to evaluate; fix: set data.val_path")
    assert _refused(capsys, tmp_path, "data.val_path=task:digit_sum", "eval.n=4", *on).startswith(
        "config error: eval.n=4: greedy evaluation (eval.temperature=0) draws the same response n times")
    assert main(["validate", os.path.join(ROOT, "configs", "demo_cpu.yaml"), f"data.val_path={questions}",
                 "data.train_path=task:add_small", "data.prompt_key=question", "eval.n=4", "eval.temperature=1",
                 *on]) == 0


def test_evaluation_response_budget_defaults_to_the_rollouts():
    from megatron_rl.config.loader import load_config
    from megatron_rl.resolve import DERIVED, SET, resolve

    derived = resolve(load_config(None, ["rollout.max_new_tokens=7"]), 1).get("eval.max_new_tokens")
    assert (derived.value, derived.origin) == (7, DERIVED)
    asked = resolve(load_config(None, ["rollout.max_new_tokens=7", "eval.max_new_tokens=20"]), 1)
    assert (asked.get("eval.max_new_tokens").value, asked.get("eval.max_new_tokens").origin) == (20, SET)
