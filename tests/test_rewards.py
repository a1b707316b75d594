"""Built-in rewards, reward lookup, the checks on what a reward function returns, the per-sample
time bound, grading on every rank, and the math_verify grader.  The labelled corpus is in
tests/test_reward_corpus.py."""

import sys
import textwrap
import threading
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from megatron_rl.errors import UserInputError
from megatron_rl.rewards import (
    RewardFunctionError,
    bounded_map,
    compute_rewards,
    exact_match,
    extract_answer,
    format_reward,
    get_reward_fn,
    grade_batch,
    has_final_answer,
    list_rewards,
    math_answer,
    math_answer_with_format,
    parse_number,
    register_reward,
)
from megatron_rl.rewards.registry import batch_reward, register_grader
from megatron_rl.testing.harness import run_distributed
from tests.data import reward_graders
from tests.data.reward_corpus import ADVERSARIAL

GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                  "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def score(response, answer, fn=math_answer):
    return fn(["q"], [response], [answer])[0]


# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize("text,expected", [
    ("#### 72", "72"),
    (GSM8K_SOLUTION, "72"),
    ("first #### 5\nthen #### 6", "6"),
    ("#### 1,000 dollars\n", "1,000 dollars"),
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{1} and finally \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\sqrt{\\frac{a}{b}}} done", "\\sqrt{\\frac{a}{b}}"),
    ("\\boxed { 7 }", "7"),
    ("#### 3 but really \\boxed{4}", "4"),
    ("\\boxed{4} but really #### 3", "3"),
    ("no final answer here", None),
    ("####", None),
    ("\\boxed{unclosed", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("72", 72.0), ("72.0", 72.0), ("72.00", 72.0), ("+72", 72.0), ("-5", -5.0), ("- 5", -5.0),
    ("\u22125", -5.0), ("1,234", 1234.0), ("1,234,567.5", 1234567.5), ("$1,000", 1000.0), ("\\$18", 18.0),
    ("50%", 0.5), ("50\\%", 0.5), ("3/4", 0.75), ("-3/4", -0.75), ("\\frac{3}{4}", 0.75),
    ("\\dfrac{3}{4}", 0.75), ("-\\frac{1}{8}", -0.125), ("{12}", 12.0), ("  12 . ", 12.0), ("1{,}000", 1000.0),
    ("\\text{12}", 12.0), (".5", 0.5), ("1e3", 1000.0), ("3 4/5", 3.8), ("3\\frac{4}{5}", 3.8), ("3½", 3.5),
    ("72 apples", 72.0), ("90^\\circ", 90.0), ("2.5 million", 2_500_000.0), ("1.5\\times10^{3}", 1500.0),
    ("12 345", 12345.0), ("0.5%", 0.005),
    ("abc", None), ("1/0", None), ("inf", None), ("nan", None), ("1_000", None), ("", None), ("x+1", None),
    ("7 2", None), ("12 34", None), ("3 5/4", None), ("2x", None), ("5 or 6", None), ("72 million apples and 3", None),
    ("1" * 5000, None),
])
def test_parse_number(text, expected):
    got = parse_number(text)
    assert got is None if expected is None else got == Fraction(str(expected))  # exact: 3.8 is 19/5


def test_parse_number_is_exact_past_float_range_and_precision():
    assert parse_number("1e400") == 10**400 != parse_number("2e400")
    assert parse_number("100000000000000000001") - parse_number("100000000000000000000") == 1
    assert parse_number("0.1\\overline{6}") == Fraction(1, 6)


# ---------------------------------------------------------------- math_answer


@pytest.mark.parametrize("response,answer", [
    (GSM8K_SOLUTION, "72"),
    ("So she sold 72 in total.\n#### 72", GSM8K_SOLUTION),  # the reference is a full GSM8K solution
    ("#### 72", "#### 72"),
    ("#### 72.0", "72"),
    ("#### $72", "72"),
    ("#### 72.", "72"),
    ("#### +72", "72"),
    ("#### 1,000", "1000"),
    ("#### 1000", "1,000"),
    ("#### -3", "-3"),
    ("#### 25%", "25"),
    ("\\boxed{\\frac{3}{4}}", "0.75"),
    ("\\boxed{0.75}", "3/4"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
    ("#### 0.25", "1/4"),  # a terminating decimal is exact
    ("\\boxed{0.\\overline{3}}", "1/3"),  # so is a repeating one
    ("\\boxed{\\frac{1}{3}}", "0.33"),  # a rounded reference accepts the exact value it rounds
    ("\\boxed{\\pi}", "3.14"),
    ("#### 120", "5!"),
    ("\\boxed{\\frac{6!}{4!}}", "30"),
    ("\\boxed{12} is incorrect; the answer is \\boxed{14}.", "14"),
    ("\\boxed{\\text{Yes}}", "yes"),
    ("\\boxed{x + 1}", "x+1"),
    ("\\boxed{\\boxed{5}}", "5"),
    ("#### 72 apples", "72"),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt3"),
    ("\\boxed{x=3}", "3"),
    ("#### 50%", "0.5"),
    ("#### \u22125", "-5"),
    ("\\fbox{7}", "7"),
    ("#### 72\n\n#### Explanation\nShe sold 48 and then 24.", "72"),
])
def test_math_answer_correct(response, answer):
    assert score(response, answer) == 1.0


@pytest.mark.parametrize("response,answer", [
    ("#### 71", "72"),
    ("#### 3", "-3"),
    ("#### 0.34", "1/3"),  # 1/3 rounds to 0.33
    ("#### 0.3333333", "1/3"),  # a rounded value is not the exact answer, at any precision
    ("#### 0.333", "1/3"),
    ("\\boxed{3.14}", "\\pi"),
    ("\\boxed{1.414}", "\\sqrt{2}"),
    ("#### 5!", "5"),  # a factorial, not an exclamation
    ("\\boxed{(2+3)!}", "5"),
    ("\\boxed{12} is incorrect", "12"),
    ("So \\boxed{12}.\n\nWait, that's wrong.", "12"),
    ("The answer is not \\boxed{12}.", "12"),
    ("\\boxed{12}. Actually, the answer should be 14.", "12"),
    ("#### 12 (wrong)", "12"),
    ("The answer is 72.", "72"),  # no extractable final answer
    ("", "72"),
    ("#### 72", None),  # no reference
    ("#### 1234568", "1234567"),
    ("#### 1e400", "2e400"),
    ("#### 7 2", "72"),
    ("#### 3 4/5", "6.8"),
    ("#### 0.5%", "0.5"),
    ("\\boxed{\\Pi}", "\\pi"),
    ("\\boxed{X+1}", "x+1"),
    ("\\boxed{\\leftarrow}", "\\rightarrow"),
    ("#### 72 million", "72"),
    ("#### abc", ""),
    ("\\boxed{}", "0"),
])
def test_math_answer_wrong(response, answer):
    assert score(response, answer) == 0.0


def test_math_answer_batch_and_alias():
    responses = ["#### 1", "#### 2", "nothing", "\\boxed{4}"]
    answers = ["1", "3", "3", "#### 4"]
    assert math_answer(["q"] * 4, responses, answers) == [1.0, 0.0, 0.0, 1.0]
    assert get_reward_fn("gsm8k") is get_reward_fn("math_answer") is math_answer


def test_exact_match():
    assert exact_match(["q"] * 4, ["  Paris\n", "paris", "Paris.", "x"], ["paris", "PARIS", "Paris", None]) == [
        1.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------- format


@pytest.mark.parametrize("response,expected", [
    ("work...\n#### 72", True),
    ("#### -1,234.5\n  ", True),
    ("#### 3/4", True),
    ("the answer is \\boxed{x+1} as shown", True),
    ("#### 72\nand some more text", False),  # the #### answer must end the response
    ("#### seventy-two", False),
    ("\\boxed{}", False),
    ("72", False),
])
def test_has_final_answer(response, expected):
    assert has_final_answer(response) is expected
    assert format_reward(["q"], [response], [None]) == [1.0 if expected else 0.0]


def test_math_answer_with_format_weights():
    responses = ["#### 72", "#### 71", "72", "#### 72\nbye"]
    got = math_answer_with_format(["q"] * 4, responses, ["72"] * 4)
    assert got == pytest.approx([1.0, 0.1, 0.0, 0.9])
    got = math_answer_with_format(["q"] * 4, responses, ["72"] * 4, correct_weight=1.0, format_weight=0.5)
    assert got == pytest.approx([1.5, 0.5, 0.0, 1.0])


# ---------------------------------------------------------------- registry


def user_reward(prompts, responses, answers, bonus=0.0):
    return [float(len(r)) + bonus for r in responses]


def test_register_reward():
    from megatron_rl.rewards import registry

    names = ("test_only_const", "test_only_const_alias")

    @register_reward(*names)
    def const(prompts, responses, answers, value=1.0):
        return [value] * len(responses)

    try:
        assert get_reward_fn("test_only_const") is get_reward_fn("test_only_const_alias") is const
        assert compute_rewards("test_only_const_alias", ["p"], ["r"], [None], [0], value=2.0).tolist() == [2.0]
        with pytest.raises(RewardFunctionError, match="reward.fn=test_only_const: raised"):
            compute_rewards(const, ["p"], ["r"], [None], [0], valu=2.0)  # a misspelt keyword names the fn
        with pytest.raises(ValueError, match="already registered"):
            register_reward("math_answer")(const)
    finally:
        # The registry is process-global (no unregister): leave it as later tests expect it.
        for name in names:
            registry._REWARDS.pop(name, None)
        registry._NAMES.pop(const, None)
    assert "test_only_const" not in list_rewards()


def test_builtins_listed():
    assert {"math_answer", "gsm8k", "exact_match", "format", "math_answer_with_format"} <= set(list_rewards())


def test_resolve_module_function_from_this_module():
    fn = get_reward_fn(f"{__name__}:user_reward")
    assert fn(["a"], ["abc"], [None]) == [3.0]


def test_resolve_module_function_from_temp_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent("""
        class Scorers:
            @staticmethod
            def length(prompts, responses, answers):
                return [len(r) for r in responses]
        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards_mod", raising=False)
    fn = get_reward_fn("my_rewards_mod:Scorers.length")
    out = compute_rewards(fn, ["p", "p"], ["ab", "abcd"], [None, None], [0, 1])
    assert out.dtype == torch.float32 and out.tolist() == [2.0, 4.0]
    with pytest.raises(RewardFunctionError, match="NOT_CALLABLE.*not a function"):
        get_reward_fn("my_rewards_mod:NOT_CALLABLE")


@pytest.mark.parametrize("spec,expected", [
    ("no_such_reward", "unknown reward function"),
    ("pkg.mod.fn", "'pkg.mod:fn'"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("math:no_such_fn", "module 'math' has no attribute 'no_such_fn'"),
    ("", "must be a reward name"),
])
def test_resolve_errors(spec, expected):
    with pytest.raises(RewardFunctionError) as info:
        get_reward_fn(spec)
    err = info.value
    assert isinstance(err, UserInputError)
    assert err.key == "reward.fn" and expected in str(err) and "fix:" in str(err)
    assert "\n" not in str(err)


# ---------------------------------------------------------------- compute_rewards checks


def test_compute_rewards_accepts_list_tensor_numpy_and_kwargs():
    for ret in ([1, 0.5, True], torch.tensor([1.0, 0.5, 1.0], dtype=torch.float64), np.array([1, 0.5, 1]),
                [np.float32(1), torch.tensor(0.5), 1]):
        out = compute_rewards(lambda p, r, a, ret=ret: ret, ["p"] * 3, ["r"] * 3, [None] * 3, [5, 6, 7])
        assert out.dtype == torch.float32 and out.shape == (3,) and out.tolist() == [1.0, 0.5, 1.0]
    out = compute_rewards("math_answer_with_format", ["p"], ["#### 1"], ["2"], [0], format_weight=0.25)
    assert out.tolist() == [0.25]
    assert compute_rewards(user_reward, ["p"], ["ab"], [None], None, bonus=1.0).tolist() == [3.0]


def fails_on_seven(prompts, responses, answers):
    return [1.0 / (0 if r == "7" else 1) for r in responses]


def test_raising_fn_names_the_prompt_index():
    with pytest.raises(RewardFunctionError) as info:
        compute_rewards(fails_on_seven, ["p"] * 4, ["1", "2", "7", "8"], [None] * 4, [10, 11, 12, 13])
    msg = str(info.value)
    assert isinstance(info.value, UserInputError)
    assert "prompt index 12" in msg and "ZeroDivisionError" in msg and "fails_on_seven" in msg
    assert msg.startswith("reward error: reward.fn=") and "fix:" in msg


def test_raising_fn_on_the_batch_only():
    def batch_of_one_only(prompts, responses, answers):
        if len(responses) > 1:
            raise RuntimeError("batch too large")
        return [0.0]

    with pytest.raises(RewardFunctionError, match="batch too large.*no single response fails alone"):
        compute_rewards(batch_of_one_only, ["p"] * 2, ["a", "b"], [None] * 2, [0, 1])


def test_registered_name_in_message():
    with pytest.raises(RewardFunctionError, match=r"reward.fn=math_answer: raised TypeError.*prompt index 3"):
        compute_rewards("math_answer", ["p", "p"], ["#### 1", None], ["1", "1"], [2, 3])


@pytest.mark.parametrize("ret,expected", [
    ([1.0, 2.0], "returned 2 values for 3 responses; prompt index 22 and later got none"),
    ([1.0] * 4, "returned 4 values for 3 responses"),
    (torch.ones(3, 1), "shape (3, 1)"),
    (np.ones((1, 3)), "shape (1, 3)"),
    (1.0, "returned float 1.0, expected a list of 3 numbers"),
    (None, "returned NoneType None"),
    ([1.0, "0.5", 1.0], "non-numeric value '0.5' (str) for prompt index 21"),
    ([1.0, 1.0, None], "non-numeric value None (NoneType) for prompt index 22"),
    (np.array(["a", "b", "c"]), "non-numeric value"),
    ([1.0, float("nan"), 1.0], "non-finite value nan for prompt index 21"),
    (torch.tensor([1.0, 1.0, float("inf")]), "non-finite value inf for prompt index 22"),
    (np.array([float("-inf"), 0.0, 0.0]), "non-finite value -inf for prompt index 20"),
    (torch.tensor([1j, 0, 0]), "complex"),
])
def test_bad_return_values(ret, expected):
    with pytest.raises(RewardFunctionError) as info:
        compute_rewards(lambda p, r, a: ret, ["p"] * 3, ["r"] * 3, [None] * 3, [20, 21, 22])
    assert isinstance(info.value, UserInputError)
    assert expected in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- several boxes


@pytest.mark.parametrize("response,answer,expected", [
    ("\\boxed{2} and \\boxed{3}", "2, 3", 1.0),  # one box per item of a list reference
    ("$\\boxed{3}$, $\\boxed{2}$", "\\{2,3\\}", 1.0),  # in any order against a set
    ("\\boxed{7}\\boxed{7}", "7", 1.0),  # adjacent boxes that agree
    ("\\boxed{3} or \\boxed{4}", "4", 0.0),  # hedging: boxes that disagree with one reference
    ("\\boxed{3}, \\boxed{4}", "(3, 4)", 0.0),  # an ordered tuple is one answer, not several
    ("First \\boxed{4} (intermediate). Then: \\boxed{9}", "9", 1.0),  # boxes separated by text: last wins
    ("First \\boxed{9} (final?). Then: \\boxed{4}", "9", 0.0),
    ("".join(f"\\boxed{{{i}}}" for i in range(40)), "39", 0.0),  # more adjacent boxes than MAX_GROUP
])
def test_several_boxes_policy(response, answer, expected):
    assert score(response, answer) == expected


def test_extract_answer_joins_a_group_of_boxes():
    assert extract_answer("roots \\boxed{2} and \\boxed{-3}.") == "2, -3"
    assert extract_answer("\\boxed{2} and then we check \\boxed{3}") == "3"


# ---------------------------------------------------------------- time bound


def test_timed_out_sample_scores_zero_is_counted_and_the_rest_are_graded():
    items = [("a", None), ("loop", None), ("b", None), ("loop", None), ("c", None)]
    start = time.monotonic()
    out = bounded_map(reward_graders.loops_on, items, timeout_s=0.5)
    elapsed = time.monotonic() - start
    assert list(out) == [1.0, 0.0, 1.0, 0.0, 1.0] and out.timed_out == 2
    assert elapsed < 5.0, elapsed  # two bounds of 0.5 s plus two worker restarts


def test_reward_timeout_reaches_graders_and_is_reported():
    loops = batch_reward(reward_graders.loops_on, "loops_on")
    graded = grade_batch(loops, ["p"] * 3, ["x", "loop", "y"], [None] * 3, [0, 1, 2], timeout_s=0.3)
    assert graded.scores.tolist() == [1.0, 0.0, 1.0] and graded.timed_out == 1
    # a plain batch function never sees timeout_s
    graded = grade_batch(user_reward, ["p"], ["abc"], [None], [0], timeout_s=0.3)
    assert graded.scores.tolist() == [3.0] and graded.timed_out == 0


def test_grader_that_raises_in_the_worker_names_the_prompt():
    fn = batch_reward(reward_graders.raises_on_seven, "raises_on_seven")
    with pytest.raises(RewardFunctionError) as info:
        compute_rewards(fn, ["p"] * 3, ["12", "7", "8"], [None] * 3, [20, 21, 22], timeout_s=5.0)
    assert "prompt index 21" in str(info.value) and "seven is not allowed" in str(info.value)
    assert compute_rewards(fn, ["p"] * 2, ["12", "8"], [None] * 2, [0, 1], timeout_s=5.0).tolist() == [2.0, 1.0]


def test_a_grading_worker_that_exits_with_code_0_is_a_reward_failure():
    """A grader (or what it imports) that ends its worker with exit code 0 fails the batch's
    rewards: no sample is silently scored 0 and training does not go on as if it were graded."""
    fn = batch_reward(reward_graders.exits_on_seven, "exits_on_seven")
    with pytest.raises(RewardFunctionError) as info:
        compute_rewards(fn, ["p"] * 3, ["12", "7", "8"], [None] * 3, [20, 21, 22], timeout_s=5.0)
    assert "grading worker exited (code 0)" in str(info.value) and "prompt index 21" in str(info.value)


def test_register_grader_by_name_and_import_path():
    from megatron_rl.rewards import registry

    register_grader("test_only_loops")(reward_graders.loops_on)
    try:
        by_name = get_reward_fn("test_only_loops")
        by_path = get_reward_fn("tests.data.reward_graders:loops_on")
        assert by_name.bounded and by_path.bounded and by_name.grader is reward_graders.loops_on
        assert by_path(["p"], ["ok"], [None], timeout_s=1.0) == [1.0]
    finally:
        registry._REWARDS.pop("test_only_loops", None)


def test_grading_is_bounded_on_a_thread_other_than_main():
    out: dict = {}

    def grade():
        out["scores"] = bounded_map(reward_graders.loops_on, [("loop", None), ("x", None)], timeout_s=0.3)

    thread = threading.Thread(target=grade)
    thread.start()
    thread.join(30)
    assert list(out["scores"]) == [0.0, 1.0] and out["scores"].timed_out == 1


def test_several_grading_workers_give_the_same_scores():
    responses = [f"#### {i}" for i in range(12)]
    answers = [str(i if i % 3 else i + 1) for i in range(12)]
    one = math_answer(["q"] * 12, responses, answers)
    two = math_answer(["q"] * 12, responses, answers, grading_workers=2)
    assert one == two == [0.0 if i % 3 == 0 else 1.0 for i in range(12)]


# ---------------------------------------------------------------- adversarial inputs: linear parsing


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_input_is_graded_in_under_a_second(name):
    response, expected = ADVERSARIAL[name]
    math_answer(["q"], ["#### 1"], ["1"])  # the worker is started before the clock
    start = time.monotonic()
    out = math_answer(["q"], [response], ["72"], timeout_s=5.0)
    elapsed = time.monotonic() - start
    assert list(out) == [expected] and out.timed_out == 0
    assert elapsed < 1.0, f"{name}: {elapsed:.3f} s"


# ---------------------------------------------------------------- grading on every rank


PARALLEL_RESPONSES = ["#### 72", "\\boxed{3}", "#### 1,000", "loop", "\\boxed{\\frac12}", "#### 7 2", "\\boxed{x=3}"]
PARALLEL_ANSWERS = ["72", "4", "1000", "5", "0.5", "72", "3"]


def parallel_body(timeout_s):
    """Every rank's view of the rewards of one batch, graded in shares."""
    import torch.distributed as dist

    from megatron_rl.rewards.distributed import rewards_on_every_rank
    from megatron_rl.rewards.registry import RewardFunctionError, get_reward_fn

    n = len(PARALLEL_RESPONSES)
    graded = rewards_on_every_rank(get_reward_fn("math_answer"), ["q"] * n, PARALLEL_RESPONSES, PARALLEL_ANSWERS,
                                   list(range(100, 100 + n)), timeout_s=timeout_s)
    fails_on_seven_elsewhere = ["1", "2", "3", "7", "8"]  # "7" is in rank 1's share (positions 1, 3)
    try:
        rewards_on_every_rank(fails_on_seven, ["q"] * 5, fails_on_seven_elsewhere, [None] * 5, [10, 11, 12, 13, 14])
        failure = None
    except RewardFunctionError as err:
        failure = str(err)
    return {"rank": dist.get_rank(), "scores": graded.scores.tolist(), "timed_out": graded.timed_out,
            "failure": failure}


def test_rewards_on_every_rank_equal_one_rank():
    n = len(PARALLEL_RESPONSES)
    alone = grade_batch("math_answer", ["q"] * n, PARALLEL_RESPONSES, PARALLEL_ANSWERS, timeout_s=5.0)
    ranks = run_distributed(2, parallel_body, 5.0)
    assert alone.scores.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    for out in ranks:
        assert out["scores"] == alone.scores.tolist() and out["timed_out"] == 0
        assert "prompt index 13" in out["failure"] and "ZeroDivisionError" in out["failure"]


def test_rewards_on_every_rank_count_timeouts_over_all_ranks():
    loop_grader = "tests.data.reward_graders:loops_on"
    ranks = run_distributed(2, parallel_timeout_body, loop_grader)
    assert [r["scores"] for r in ranks] == [[1.0, 0.0, 0.0, 1.0]] * 2
    assert [r["timed_out"] for r in ranks] == [2, 2]


def parallel_timeout_body(spec):
    from megatron_rl.rewards.distributed import rewards_on_every_rank
    from megatron_rl.rewards.registry import get_reward_fn

    graded = rewards_on_every_rank(get_reward_fn(spec), ["q"] * 4, ["a", "loop", "loop", "b"], [None] * 4,
                                   [0, 1, 2, 3], timeout_s=0.3)
    return {"scores": graded.scores.tolist(), "timed_out": graded.timed_out}


# ---------------------------------------------------------------- math_verify


def test_math_verify_adds_symbolic_equivalence_and_keeps_the_contract():
    pytest.importorskip("math_verify")
    from megatron_rl.rewards import math_verify

    responses = ["\\boxed{\\sin^2 x + \\cos^2 x}", "#### 1e3", "\\boxed{X+1}", "\\boxed{\\Pi}", "#### 1234568",
                 "\\boxed{3} or \\boxed{4}", "\\boxed{\\ln(e^2)}", "#### \u22125", "\\fbox{7}"]
    answers = ["1", "1000", "x+1", "\\pi", "1234567", "4", "2", "-5", "7"]
    assert math_verify(["q"] * 9, responses, answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def test_math_verify_pays_no_decimal_for_an_exact_value_and_reads_factorials():
    """math-verify rounds floats to 6 places; here it sees decimals as exact fractions."""
    pytest.importorskip("math_verify")
    from megatron_rl.rewards import math_verify

    responses = ["\\boxed{3.1415927}", "\\boxed{1.4142136}", "\\boxed{0.8660254}", "\\boxed{0.5}", "#### 5!",
                 "\\boxed{120}", "\\boxed{0.3333333}", "\\boxed{12} is incorrect"]
    answers = ["\\pi", "\\sqrt{2}", "\\sin(\\pi/3)", "\\sin(\\pi/6)", "5", "5!", "1/3", "12"]
    assert math_verify(["q"] * 8, responses, answers) == [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_math_verify_is_bounded_and_thread_safe():
    pytest.importorskip("math_verify")
    from megatron_rl.rewards import math_verify

    math_verify(["q"], ["\\boxed{1}"], ["1"])  # start the worker (SymPy import) before the clock
    results: list = [None] * 3

    def grade(k):
        results[k] = list(math_verify(["q"] * 2, ["\\boxed{(x+1)^2}", "\\boxed{\\log_2 8}"], ["x^2+2x+1", "3"],
                                      timeout_s=20.0))

    threads = [threading.Thread(target=grade, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [[1.0, 1.0]] * 3


def test_a_deadline_longer_than_a_thread_can_wait_is_still_watched():
    """reward.timeout_s (up to 7 days) x a batch's responses can pass what a thread may wait: the
    watchdog used to die of OverflowError at once, leaving the reward unwatched."""
    import threading
    import time

    from megatron_rl.rewards.registry import hard_deadline

    failures = []
    previous, threading.excepthook = threading.excepthook, lambda args: failures.append(args.exc_value)
    try:
        with hard_deadline(7 * 86400 * 20_000.0, RuntimeError("late")):
            time.sleep(0.3)
    finally:
        threading.excepthook = previous
    assert failures == []
