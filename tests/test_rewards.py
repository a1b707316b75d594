"""Built-in rewards, reward lookup, and the checks on what a reward function returns."""

import sys
import textwrap

import numpy as np
import pytest
import torch

from megatron_rl.errors import UserInputError
from megatron_rl.rewards import (
    RewardFunctionError,
    compute_rewards,
    exact_match,
    extract_answer,
    format_reward,
    get_reward_fn,
    has_final_answer,
    list_rewards,
    math_answer,
    math_answer_with_format,
    parse_number,
    register_reward,
)

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
    ("50%", 50.0), ("50\\%", 50.0), ("3/4", 0.75), ("-3/4", -0.75), ("\\frac{3}{4}", 0.75),
    ("\\dfrac{3}{4}", 0.75), ("-\\frac{1}{8}", -0.125), ("{12}", 12.0), ("  12 . ", 12.0), ("1{,}000", 1000.0),
    ("\\text{12}", 12.0), (".5", 0.5), ("1e3", 1000.0),
    ("abc", None), ("1/0", None), ("inf", None), ("nan", None), ("1_000", None), ("", None), ("x+1", None),
])
def test_parse_number(text, expected):
    assert parse_number(text) == expected


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
    ("#### 0.3333333", "1/3"),  # within 1e-6 relative
    ("\\boxed{\\text{Yes}}", "yes"),
    ("\\boxed{x + 1}", "x+1"),
    ("\\boxed{\\boxed{5}}", "5"),
])
def test_math_answer_correct(response, answer):
    assert score(response, answer) == 1.0


@pytest.mark.parametrize("response,answer", [
    ("#### 71", "72"),
    ("#### 3", "-3"),
    ("#### 0.333", "1/3"),  # outside the tolerance
    ("The answer is 72.", "72"),  # no extractable final answer
    ("", "72"),
    ("#### 72 apples", "72"),  # a unit after the number is not a number
    ("#### 72", None),  # no reference
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
    with pytest.raises(RewardFunctionError, match=r"reward.fn=math_answer: raised AttributeError.*prompt index 3"):
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
