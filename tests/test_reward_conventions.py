"""Reward functions as TRL and verl users write them: TRL's ``fn(completions, **kwargs)``, binding
by parameter name, every dataset column reaching the reward, and ``reward.fn`` as a file path."""

from __future__ import annotations

import json
import os

import pytest

from megatron_rl.data.prompts import load_prompts
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.rewards.conventions import needs_answers
from megatron_rl.rewards.registry import RewardFunctionError, detected_convention, get_reward_fn, grade_batch
from megatron_rl.testing.cli_runner import run_cli
from megatron_rl.tools.cli import main
from tests.support.helpers import TINY, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
CHAR = CharTokenizer()
HERE = __name__
SEEN: dict = {}  # what the functions below were called with, for the assertions


# ---------------------------------------------------------------- functions as TRL users write them


def trl_accuracy(completions, solution, **kwargs):
    """TRL's standard form: completions are strings, the dataset column ``solution`` arrives by name."""
    SEEN["accuracy"] = {"completions": completions, "solution": solution, **kwargs}
    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]


def trl_format(prompts, completions, **kwargs):
    """TRL's conversational form: prompts are message lists, completions ``[{"role", "content"}]`` lists."""
    SEEN["format"] = {"prompts": prompts, "completions": completions, **kwargs}
    return [float(len(c[0]["content"])) for c in completions]


def trl_sometimes_none(completions, **kwargs):
    """TRL lets a function return None for a sample it does not reward."""
    return [None if c == "skip" else 1.0 for c in completions]


def with_ids(prompts, completions, completion_ids, **kwargs):
    """The reported case: named like TRL, once accepted as the positional (prompts, responses, answers)."""
    return [float(len(ids)) for ids in completion_ids]


def needs_trainer_state(completions, trainer_state):
    return [0.0] * len(completions)


def three_unnamed(a, b, c):
    return [0.0] * len(b)


def batch_with_columns(prompts, responses, answers, difficulty=None, **kwargs):
    """The project's batch form: ``difficulty`` binds to its column, other columns land in kwargs."""
    SEEN["batch"] = {"difficulty": difficulty, **kwargs}
    return [float(d) for d in difficulty]


def synonym_batch(queries, outputs, references):
    return [float(o == r) for o, r in zip(outputs, references)]


# ---------------------------------------------------------------- TRL's convention


def test_trl_functions_are_detected_and_get_completions_prompts_and_columns_by_name():
    assert detected_convention(f"{HERE}:trl_accuracy") == "trl"
    fn = get_reward_fn(f"{HERE}:trl_accuracy")
    assert not needs_answers(fn)  # it reads the dataset's own column, not data.answer_key
    records = [{"prompt": "1+1=", "solution": "2", "level": 1}, {"prompt": "2+2=", "solution": "4", "level": 3}]
    graded = grade_batch(fn, ["1+1=", "2+2="], [" 2", "5"], [None, None], fields=records, completion_ids=[[5], [6]])
    assert graded.scores.tolist() == [1.0, 0.0]
    seen = SEEN["accuracy"]
    assert seen["completions"] == [" 2", "5"] and seen["solution"] == ["2", "4"] and seen["level"] == [1, 3]
    assert seen["completion_ids"] == [[5], [6]] and seen["prompts"] == ["1+1=", "2+2="]
    assert "prompt" not in seen and "trainer_state" not in seen  # TRL passes the prompt column as prompts


def test_trl_conversational_prompts_are_message_lists_and_completions_assistant_messages():
    fn = get_reward_fn(f"{HERE}:trl_format", "trl")
    chat = [{"role": "user", "content": "1+1="}]
    graded = grade_batch(fn, ["<rendered>"], ["abc"], [None], fields=[{"prompt": chat, "tag": "x"}])
    assert graded.scores.tolist() == [3.0]
    assert SEEN["format"]["prompts"] == [chat]
    assert SEEN["format"]["completions"] == [[{"role": "assistant", "content": "abc"}]]
    assert SEEN["format"]["tag"] == ["x"]


def test_trl_none_scores_zero_and_is_counted():
    fn = get_reward_fn(f"{HERE}:trl_sometimes_none")
    graded = grade_batch(fn, ["p"] * 3, ["a", "skip", "b"], [None] * 3, fields=[{}] * 3)
    assert graded.scores.tolist() == [1.0, 0.0, 1.0] and graded.no_reward == 1


def test_names_bind_the_arguments_and_names_fitting_no_convention_are_refused():
    fn = get_reward_fn(f"{HERE}:with_ids")
    graded = grade_batch(fn, ["p", "p"], ["ab", "abc"], ["answer one", "two"], completion_ids=[[1, 2], [1, 2, 3]])
    assert graded.scores.tolist() == [2.0, 3.0]  # the token ids, never the answer strings
    with pytest.raises(RewardFunctionError) as info:
        get_reward_fn(f"{HERE}:with_ids", "batch")
    assert "does not fit reward.convention=batch" in str(info.value) and "(prompts, completions, completion_ids" \
        in str(info.value)
    with pytest.raises(RewardFunctionError) as info:
        get_reward_fn(f"{HERE}:three_unnamed")  # three positional parameters, none of them named as a convention
    line = str(info.value)
    assert "fits no calling convention" in line and "(trl)" in line and "(verl)" in line and "(batch)" in line
    assert len(line.splitlines()) == 1
    with pytest.raises(RewardFunctionError, match="trainer_state"):
        get_reward_fn(f"{HERE}:needs_trainer_state")
    fn = get_reward_fn(f"{HERE}:synonym_batch")
    assert grade_batch(fn, ["p"], ["7"], ["7"]).scores.tolist() == [1.0]


# ---------------------------------------------------------------- every column reaches the reward


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "difficulty": i, "meta": {"source": "s"}} for i in range(3)]


def _columns_reach_a_batch_function(path: str) -> None:
    ps = load_prompts(path, CHAR, 32)
    fields = ps.record_fields([2, 0])
    assert [f["difficulty"] for f in fields] == [2, 0] and fields[0]["meta"] == {"source": "s"}
    fn = get_reward_fn(f"{HERE}:batch_with_columns")
    graded = grade_batch(fn, [ps.prompts[i] for i in (2, 0)], ["x", "y"], ["4", "0"], fields=fields)
    assert graded.scores.tolist() == [2.0, 0.0]
    assert SEEN["batch"]["meta"] == [{"source": "s"}] * 2 and SEEN["batch"]["answer"] == ["4", "0"]


def test_every_dataset_column_of_a_jsonl_file_reaches_batch_functions(tmp_path):
    _columns_reach_a_batch_function(write_jsonl(tmp_path / "p.jsonl", ROWS))


def test_every_dataset_column_of_a_parquet_file_reaches_batch_functions(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "p.parquet")
    _columns_reach_a_batch_function(str(tmp_path / "p.parquet"))


def columns_on_ranks_body():
    from megatron_rl.rewards.distributed import rewards_on_every_rank

    fields = [{"difficulty": i, "solution": str(i)} for i in range(5)]
    batch = rewards_on_every_rank(get_reward_fn(f"{HERE}:batch_with_columns"), ["p"] * 5, ["r"] * 5, [None] * 5,
                                  list(range(5)), fields=fields)
    trl = rewards_on_every_rank(get_reward_fn(f"{HERE}:trl_accuracy"), ["p"] * 5, ["0", "x", "2", "x", "4"],
                                [None] * 5, list(range(5)), fields=fields)
    return batch.scores.tolist(), trl.scores.tolist()


def test_columns_follow_their_samples_to_the_rank_that_grades_them():
    from megatron_rl.testing.harness import run_distributed

    assert run_distributed(2, columns_on_ranks_body) == [([0.0, 1.0, 2.0, 3.0, 4.0], [1.0, 0.0, 1.0, 0.0, 1.0])] * 2


# ---------------------------------------------------------------- reward.fn as a file path


REWARD_FILE = '''
from megatron_rl.rewards import grader


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


@grader
def graded(response, answer, difficulty=0):
    """Graded in the worker process, which imports this file by its path; a column by name."""
    return float(response == answer) + difficulty
'''


def test_reward_fn_as_a_file_path_imports_by_path_here_and_in_the_grading_worker(tmp_path, monkeypatch):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    fn = get_reward_fn(str(path))  # verl's default name: compute_score
    assert grade_batch(fn, ["p", "p"], ["a", "b"], ["a", "a"]).scores.tolist() == [1.0, 0.0]
    monkeypatch.chdir(tmp_path)
    fn = get_reward_fn("my_reward.py:graded")
    graded = grade_batch(fn, ["p", "p"], ["a", "b"], ["a", "a"], timeout_s=30.0,
                         fields=[{"difficulty": 2}, {"difficulty": 0}])
    assert graded.scores.tolist() == [3.0, 0.0]
    for spec, words in ((str(tmp_path / "absent.py"), "no such file"), (f"{path}:absent", "has no function 'absent'")):
        with pytest.raises(RewardFunctionError) as info:
            get_reward_fn(spec)
        assert str(info.value).startswith(f"reward error: reward.fn={spec}: ") and words in str(info.value)


def test_validate_refuses_a_reward_file_that_does_not_exist(capsys, tmp_path):
    spec = f"{tmp_path}/absent.py:score"
    code = main(["validate", DEMO, f"run.dir={tmp_path}/runs", f"reward.fn={spec}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"reward error: reward.fn={spec}: no such file"), err


def test_validate_refuses_data_without_a_column_the_reward_requires_by_name(capsys, tmp_path):
    """A TRL function naming a dataset column (``solution``) the records lack: refused before launch
    with the record and the fix, not on the first step."""
    (tmp_path / "rewards.py").write_text("def accuracy(completions, solution, **kwargs):\n"
                                         "    return [float(c == s) for c, s in zip(completions, solution)]\n")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "solution": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    code = main(["validate", DEMO, f"run.dir={tmp_path}/runs", f"reward.fn={tmp_path}/rewards.py:accuracy",
                 f"data.train_path={data}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{data}:2" in err[0] and "'solution'" in err[0] and err[0].startswith("reward error: reward.fn="), err


# ---------------------------------------------------------------- end to end


TRL_REWARDS = '''
import re
from megatron_rl.testing.cli_runner import run_cli


def format_reward(completions, **kwargs):
    """Reward function that checks if the completion is only digits (conversational data)."""
    completion_contents = [completion[0]["content"] for completion in completions]
    return [sum(ch.isdigit() for ch in content) / max(len(content), 1) for content in completion_contents]


def accuracy_reward(completions, solution, **kwargs):
    """1 for the solution, 0.5 for a completion that holds a digit (a random model's signal)."""
    rewards = []
    for content, sol in zip(completions, solution):
        rewards.append(1.0 if content.strip() == sol else 0.5 if re.search(r"[0-9]", content) else 0.0)
    return rewards
'''


def _recompute(name: str, response: str, solution: str) -> float:
    if name == "format_reward":
        return sum(ch.isdigit() for ch in response) / max(len(response), 1)
    return 1.0 if response.strip() == solution else 0.5 if any(ch in "0123456789" for ch in response) else 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name, conversational", [("format_reward", True), ("accuracy_reward", False)])
def test_trl_reward_functions_unchanged(tmp_path, name, conversational):
    """TRL's reward functions and dataset, a reward file by path: the logged rewards are what they compute."""
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}="}] if conversational else f"{i}+{i}=",
             "solution": str(2 * i)} for i in range(1, 9)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    proc = run_cli("train", *TINY, f"data.train_path={data}", "data.max_prompt_tokens=40",
                   f"reward.fn={tmp_path}/trl_rewards.py:{name}", "trainer.steps=2", "trainer.log_samples=true",
                   f"run.dir={tmp_path}", "run.name=trl", timeout=600)
    assert proc.returncode == 0, proc.stderr
    metrics = read_metrics(tmp_path / "trl")
    assert len(metrics) == 2
    seen = set()
    for row in metrics:
        with open(tmp_path / "trl" / "samples" / f"step_{row['step']:08d}.jsonl") as fh:
            samples = [json.loads(line) for line in fh]
        expected = [_recompute(name, s["response"], rows[s["dataset_index"]]["solution"]) for s in samples]
        assert [s["reward"] for s in samples] == pytest.approx(expected)
        assert row["reward/mean"] == pytest.approx(sum(expected) / len(expected))
        assert row["reward/none"] == 0  # both functions reward every completion
        seen.update(expected)
    assert len(seen) > 1, seen  # the rewards vary: what is compared is the functions' work, not a constant
