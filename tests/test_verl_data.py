"""verl users' data and reward functions: nested record keys, chat prompts, missing answers refused,
no-signal warnings, and verl's compute_score signature."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_rl.data.prompts import check_prompt_file, load_prompts
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.errors import DataError
from megatron_rl.rewards.conventions import needs_answers
from megatron_rl.rewards.registry import RewardFunctionError, get_reward_fn, grade_batch
from megatron_rl.trainer.reward_signal import NO_SIGNAL_BATCHES, RewardSignal
from tests.support.helpers import TINY, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAR = CharTokenizer()
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def verl_records(n: int = 4) -> list[dict]:
    """Rows in verl's Parquet schema (as its gsm8k preprocessing writes them)."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{i}+{i}="}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def write_verl_parquet(path, n: int = 4) -> str:
    pq.write_table(pa.Table.from_pylist(verl_records(n)), path)
    return str(path)


def cli(*args, env=None, timeout=600):
    """The CLI as its own process, forked from one with the imports done (no interpreter start each)."""
    from megatron_rl.testing.cli_runner import run_cli

    full = dict(os.environ, **(env or {}))
    return run_cli(*args, env=full, cwd=ROOT, timeout=timeout)


# ---------------------------------------------------------------- records


def test_verl_parquet_reads_nested_answer_chat_prompt_and_record_fields(tmp_path):
    path = write_verl_parquet(tmp_path / "train.parquet")
    ps = load_prompts(path, CHAR, 64, answer_key="reward_model.ground_truth")
    assert ps.answers == ["0", "2", "4", "6"]
    assert ps.prompts[3] == "user: 3+3=\nassistant: "  # the chat under 'prompt', through the chat template
    assert ps.prompt_ids[3] == CHAR.apply_chat_template([{"role": "user", "content": "3+3="}])
    assert ps.record_fields([1]) == [verl_records()[1]]  # every column of the record


def test_dotted_keys_for_prompt_and_messages_and_a_literal_dotted_key_wins(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"q": {"text": "1+1="}, "a": {"b": 2}, "a.b": "literal"},
            {"q": {"chat": [{"role": "user", "content": "2+2="}]}, "a": {"b": 4}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_prompts(path, CHAR, 64, prompt_key="q.text", answer_key="a.b", messages_key="q.chat")
    assert ps.prompts == ["1+1=", "user: 2+2=\nassistant: "]
    assert ps.answers == ["literal", "4"]  # the record's own "a.b" key wins over the path a -> b
    assert ps.record_fields([0, 1]) == rows  # every column, as the file holds it


def test_a_bad_chat_under_the_prompt_key_names_the_key(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"'prompt'\[0\] is not a message"):
        load_prompts(path, CHAR, 64)


def test_answer_key_missing_from_the_first_record_is_refused_naming_the_keys_and_the_fix(tmp_path):
    path = write_verl_parquet(tmp_path / "train.parquet")
    check_prompt_file(path, answer_key="gt", needs_answers=False)  # a reward that reads no answers does not care
    with pytest.raises(DataError) as info:
        check_prompt_file(path, answer_key="gt", needs_answers=True)
    line = str(info.value)
    assert line.startswith("data error: data.answer_key=gt: is not a key of the first record")
    assert "'reward_model.ground_truth'" in line and "'extra_info.index'" in line
    assert "fix: set data.answer_key=reward_model.ground_truth" in line and "\n" not in line
    check_prompt_file(path, answer_key="reward_model.ground_truth", needs_answers=True)
    other = tmp_path / "other.jsonl"  # the likeliest name is suggested: an answer before a worked solution
    other.write_text(json.dumps({"prompt": "1+2=", "solution": "1+2=3", "meta": {"answer": "3"}}) + "\n")
    with pytest.raises(DataError, match=r"keys: \['meta.answer', 'prompt', 'solution'\].*"
                                        r"fix: set data.answer_key=meta.answer,"):
        check_prompt_file(other, answer_key="gt", needs_answers=True)


def test_the_default_answer_key_reads_verls_ground_truth(tmp_path):
    """A verl data file needs no key set: at its default, data.answer_key reads verl's
    reward_model.ground_truth where the records have no 'answer' (an 'answer' still wins)."""
    path = write_verl_parquet(tmp_path / "train.parquet")
    assert check_prompt_file(path, needs_answers=True) == "reward_model.ground_truth"
    read = load_prompts(path, CHAR, 64)
    assert read.answers == ["0", "2", "4", "6"] and read.answer_key == "reward_model.ground_truth"
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "reward_model": {"ground_truth": "x"}}) + "\n")
    assert load_prompts(both, CHAR, 64).answers == ["2"] and check_prompt_file(both, needs_answers=True) == "answer"


def test_validate_refuses_a_verl_file_without_the_answer_key_before_launch(tmp_path):
    path = write_verl_parquet(tmp_path / "train.parquet")
    base = ["validate", *TINY, f"data.train_path={path}", "data.max_prompt_tokens=40", "reward.fn=exact_match"]
    # The chat read through data.messages_key (the prompt key absent), as it could be read before.
    for keys in (["data.prompt_key=question", "data.messages_key=prompt"], []):
        proc = cli(*base, *keys, "data.answer_key=ground_truth")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("data error: data.answer_key=ground_truth: is not a key"), last
        proc = cli(*base, *keys)
        assert proc.returncode == 0 and "config OK" in proc.stdout, proc.stderr
        assert "data: answers read from reward_model.ground_truth (verl's schema" in proc.stderr


# ---------------------------------------------------------------- reward conventions


def test_verl_compute_score_gets_the_record_fields_and_dict_or_float_results():
    fn = get_reward_fn("tests.data.verl_rewards:compute_score")
    fields = [{"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": i}} for i in range(3)]
    graded = grade_batch(fn, ["p"] * 3, ["r"] * 3, ["0", "2", "5"], fields=fields)
    assert graded.scores.tolist() == [1.0, 1.0, 0.0]  # a dict's "score"; the third ground truth is wrong
    # Without fields (a built-in task) verl's arguments are None, as verl passes them.
    assert grade_batch(fn, ["p"], ["r"], ["0"]).scores.tolist() == [0.0]
    strict = get_reward_fn("tests.data.verl_rewards:strict_score")
    out = grade_batch(strict, ["p"] * 2, ["x 12", "none"], ["12", "12"], bonus=0.25)  # reward.kwargs by keyword
    assert out.scores.tolist() == [1.25, 0.75]


def verl_on_ranks_body():
    from megatron_rl.rewards.distributed import rewards_on_every_rank

    fields = [{"data_source": "openai/gsm8k", "extra_info": {"split": "train", "index": i}} for i in range(5)]
    answers = ["0", "2", "0", "6", "8"]  # the third is wrong
    graded = rewards_on_every_rank(get_reward_fn("tests.data.verl_rewards:compute_score"), ["p"] * 5, ["r"] * 5,
                                   answers, list(range(5)), fields=fields)
    return graded.scores.tolist()


def test_record_fields_follow_their_samples_to_the_rank_that_grades_them():
    from megatron_rl.testing.harness import run_distributed

    assert run_distributed(2, verl_on_ranks_body) == [[1.0, 1.0, 0.0, 1.0, 1.0]] * 2


def test_a_verl_function_failing_on_a_sample_names_the_prompt_with_its_fields():
    strict = get_reward_fn("tests.data.verl_rewards:strict_score")
    fields = [{"data_source": "a"}, {"data_source": "b"}]
    with pytest.raises(RewardFunctionError, match="raised TypeError: .* on prompt index 8"):
        grade_batch(strict, ["p"] * 2, ["1", "2"], ["1", None], prompt_indices=[7, 8], fields=fields)


def test_signatures_fitting_no_convention_are_refused_naming_the_conventions():
    with pytest.raises(RewardFunctionError) as info:
        get_reward_fn("tests.data.verl_rewards:undecorated_grader")
    line = str(info.value)
    assert line.startswith("reward error: reward.fn=tests.data.verl_rewards:undecorated_grader: "
                           "undecorated_grader(response, answer) fits no calling convention")
    for convention in ("fn(prompts, responses, answers, **kwargs)", "@megatron_rl.rewards.grader",
                       "compute_score(data_source, solution_str, ground_truth, extra_info=None)"):
        assert convention in line
    with pytest.raises(RewardFunctionError, match="does not fit reward.convention=verl"):
        get_reward_fn("tests.support.helpers:digit_share", "verl")
    assert get_reward_fn("math_answer", "batch") is get_reward_fn("math_answer")


def test_required_parameters_that_reward_kwargs_fill_are_accepted():
    for name in ("scaled_batch", "scaled_verl"):
        spec = f"tests.data.verl_rewards:{name}"
        with pytest.raises(RewardFunctionError, match="scale"):
            get_reward_fn(spec)
        fn = get_reward_fn(spec, kwargs={"scale": 2.0})
        assert grade_batch(fn, ["p"], ["ab"], ["ab"], scale=2.0).scores.tolist() == [4.0 if name == "scaled_batch"
                                                                                      else 2.0]


def test_validate_refuses_a_reward_signature_before_launch():
    proc = cli("validate", *TINY, "reward.fn=tests.data.verl_rewards:undecorated_grader")
    assert proc.returncode == 2
    assert "fits no calling convention" in proc.stderr.strip().splitlines()[-1]


def test_which_rewards_need_answers():
    assert needs_answers(get_reward_fn("math_answer")) and needs_answers(get_reward_fn("exact_match"))
    assert not needs_answers(get_reward_fn("format"))  # its grader's answer defaults to None
    assert needs_answers(get_reward_fn("tests.data.verl_rewards:compute_score"))
    assert not needs_answers(get_reward_fn("tests.data.verl_rewards:answer_free"))


# ---------------------------------------------------------------- per step


def test_a_batch_without_any_answer_stops_and_one_with_some_goes_on():
    signal = RewardSignal("reward_model.ground_truth", True, print)
    signal.check_answers(["1", None], [0, 1])
    with pytest.raises(DataError) as info:
        signal.check_answers([None] * 4, [5, 5, 9, 9])
    assert str(info.value).startswith("data error: data.answer_key=reward_model.ground_truth: every one of this "
                                      "step's 4 samples has no answer (prompt indices [5, 9]")
    RewardSignal("answer", False, print).check_answers([None] * 4, [0, 1, 2, 3])  # no answers needed


def test_no_signal_warning_once_after_equal_rewards_in_every_group():
    lines: list[str] = []
    signal = RewardSignal("answer", True, lines.append)
    groups = {0: [0, 1], 1: [2, 3]}
    for _ in range(NO_SIGNAL_BATCHES + 2):
        signal.observe(torch.tensor([0.0, 0.0, 1.0, 1.0]), groups)
    assert len(lines) == 1 and lines[0].startswith("warning: no learning signal: all groups had equal rewards in "
                                                   f"each of the first {NO_SIGNAL_BATCHES} steps (mean rewards 0.5")
    lines.clear()
    signal = RewardSignal("answer", True, lines.append)
    signal.observe(torch.tensor([0.0, 1.0, 1.0, 1.0]), groups)  # a signal first: never warns
    for _ in range(NO_SIGNAL_BATCHES + 1):
        signal.observe(torch.zeros(4), groups)
    assert lines == []
    signal = RewardSignal("answer", True, lines.append, batches=2)  # groups of one: the whole batch decides
    signal.observe(torch.tensor([1.0, 2.0]), {0: [0], 1: [1]})
    assert lines == []
    signal = RewardSignal("answer", True, lines.append, batches=2)
    for _ in range(2):
        signal.observe(torch.tensor([1.0, 1.0]), {0: [0], 1: [1]})
    assert len(lines) == 1


def test_verl_parquet_and_compute_score_train_end_to_end(tmp_path):
    path = write_verl_parquet(tmp_path / "train.parquet")
    proc = cli("train", *TINY, f"data.train_path={path}", "data.max_prompt_tokens=40",
               "reward.fn=tests.data.verl_rewards:compute_score",
               "trainer.steps=1", f"run.dir={tmp_path}", "run.name=verl")
    assert proc.returncode == 0, proc.stderr
    # 1.0 exactly: every sample's data_source, extra_info and nested ground truth reached compute_score.
    assert [row["reward/mean"] for row in read_metrics(tmp_path / "verl")] == [1.0]


def test_train_stops_on_a_step_without_answers_and_warns_when_rewards_carry_no_signal(tmp_path):
    rows = [{"prompt": f"{i}+{i}=", "answer": None} for i in range(4)]  # the key is there, the answers not
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = ["train", *TINY, f"data.train_path={path}", f"run.dir={tmp_path}"]
    proc = cli(*run, "reward.fn=exact_match", "trainer.steps=1", "run.name=a")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("data error: data.answer_key=answer: every one of this step's 8 samples has no answer")
    assert not os.path.exists(tmp_path / "a" / "metrics.jsonl") or read_metrics(tmp_path / "a") == []

    steps = NO_SIGNAL_BATCHES + 1
    proc = cli(*run, "reward.fn=format", f"trainer.steps={steps}", "run.name=b")  # a tiny model never formats
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if "no learning signal" in line]
    assert len(warnings) == 1 and f"each of the first {NO_SIGNAL_BATCHES} steps" in warnings[0], proc.stdout
    assert all(row["reward/std"] == 0.0 for row in read_metrics(tmp_path / "b"))
