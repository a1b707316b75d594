"""The math graders on the hand-labelled corpus of tests/data/reward_corpus.py.

The bar: no false positive (a wrong answer scored 1) and at least 90% accuracy; the
tests hold the graders to what they measured when written (95% and 98%).
``pytest tests/test_reward_corpus.py -s`` prints the figures quoted in docs/rewards.md.
"""

import collections

import pytest

from megatron_rl.rewards import math_answer
from tests.data.reward_corpus import CASES

ISSUE_CLASSES = ("fp:tolerance", "fp:overflow", "fp:precision", "fp:whitespace", "fp:percent", "fp:case",
                 "fp:left-right", "miss:units", "miss:braceless", "miss:symbolic", "miss:assignment",
                 "miss:percent", "miss:unicode", "miss:bold", "miss:heading", "keep:hashes", "keep:minus",
                 "keep:fbox", "keep:scientific", "keep:boxes", "fp:factorial", "fp:rounding",
                 "fp:constant-decimal", "fp:retracted", "keep:factorial", "keep:exact", "keep:constant",
                 "keep:last-box")


def evaluate(fn) -> dict:
    """Accuracy, false positives and misses of reward ``fn`` on the corpus."""
    scores = fn(["q"] * len(CASES), [c[1] for c in CASES], [c[2] for c in CASES], timeout_s=30.0)
    false_pos = [c for c, s in zip(CASES, scores) if s > c[3]]
    misses = [c for c, s in zip(CASES, scores) if s < c[3]]
    return {"cases": len(CASES), "accuracy": 1 - (len(false_pos) + len(misses)) / len(CASES),
            "false_positives": false_pos, "misses": misses, "timed_out": scores.timed_out}


def report(name: str, result: dict) -> str:
    lines = [f"{name}: accuracy {result['accuracy']:.1%} on {result['cases']} cases, "
             f"{len(result['false_positives'])} false positives, {len(result['misses'])} misses"]
    lines += [f"  false positive [{c[0]}] {c[1]!r} vs {c[2]!r}: {c[4]}" for c in result["false_positives"]]
    lines += [f"  miss [{c[0]}] {c[1]!r} vs {c[2]!r}: {c[4]}" for c in result["misses"]]
    return "\n".join(lines)


def test_corpus_covers_the_classes_of_the_issue():
    per_class = collections.Counter(c[0] for c in CASES)
    assert len(CASES) >= 150
    assert all(per_class[k] >= 2 for k in ISSUE_CLASSES), {k: per_class[k] for k in ISSUE_CLASSES}
    assert all(c[3] in (0, 1) and c[4] for c in CASES)
    assert sum(c[3] == 0 for c in CASES) >= 75  # as many traps as right answers, roughly


def test_math_answer_on_the_corpus_no_false_positive_at_least_95_percent():
    result = evaluate(math_answer)
    print("\n" + report("math_answer", result))
    assert result["false_positives"] == [], report("math_answer", result)
    assert result["accuracy"] >= 0.95 and result["timed_out"] == 0, report("math_answer", result)


def test_math_verify_on_the_corpus_no_false_positive_at_least_98_percent():
    pytest.importorskip("math_verify")
    from megatron_rl.rewards import math_verify

    result = evaluate(math_verify)
    print("\n" + report("math_verify", result))
    assert result["false_positives"] == [], report("math_verify", result)
    assert result["accuracy"] >= 0.98 and result["timed_out"] == 0, report("math_verify", result)
