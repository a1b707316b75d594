"""The math graders: accuracy and false positives on the labelled corpus, and time on adversarial inputs.

    python benchmarks/reward_grading.py              # corpus table + adversarial timings
    python benchmarks/reward_grading.py --verbose    # also every case a grader gets wrong

Corpus: tests/data/reward_corpus.py (hand-labelled; a false positive is a wrong answer scored 1).
Graders: ``math_answer`` (exact), ``math_verify`` (this package's extraction, math-verify's
comparison; needs the ``.[math]`` extra) and, for comparison, math-verify on its own (its own
extraction of the whole response, its signal timeouts; main thread only).  Timings are wall time
of one call of the bounded ``math_answer`` (worker process already started), best of three.

    grader                 accuracy   false positives   misses
    math_answer               ...           ...            ...
"""

from __future__ import annotations

import argparse
import os
import runpy
import time

from megatron_rl.rewards import math_answer

# The hand-labelled corpus is test data (tests/data/), read by path: the package is installed,
# the tests are not.
_CORPUS = runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                      "tests", "data", "reward_corpus.py"))
ADVERSARIAL, CASES = _CORPUS["ADVERSARIAL"], _CORPUS["CASES"]


def plain_math_verify(prompts, responses, answers, **kwargs) -> list[float]:
    """math-verify as its README uses it: parse the whole response and the gold answer, verify."""
    from math_verify import parse, verify

    out = []
    for response, answer in zip(responses, answers):
        if answer is None:
            out.append(0.0)
            continue
        gold = parse(answer if "\\boxed" in answer or "####" in answer else f"${answer}$")
        out.append(1.0 if verify(gold, parse(response)) else 0.0)
    return out


def corpus_row(name: str, fn, verbose: bool) -> None:
    kwargs = {"timeout_s": 30.0} if getattr(fn, "bounded", False) else {}
    scores = fn(["q"] * len(CASES), [c[1] for c in CASES], [c[2] for c in CASES], **kwargs)
    wrong = [(c, s) for c, s in zip(CASES, scores) if s != c[3]]
    false_pos = sum(s > c[3] for c, s in wrong)
    print(f"{name:22s} {1 - len(wrong) / len(CASES):8.1%} {false_pos:17d} {len(wrong) - false_pos:8d}")
    if verbose:
        for case, s in wrong:
            print(f"    {'FP  ' if s > case[3] else 'miss'} [{case[0]}] {case[1][:60]!r} vs {case[2]!r}: {case[4]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()

    print(f"corpus: {len(CASES)} cases, {sum(c[3] == 0 for c in CASES)} of them wrong answers")
    print(f"{'grader':22s} {'accuracy':>8s} {'false positives':>17s} {'misses':>8s}")
    corpus_row("math_answer", math_answer, args.verbose)
    try:
        import math_verify  # noqa: F401
    except ImportError:
        print("math_verify            (not installed: pip install 'megatron_rl[math]')")
    else:
        from megatron_rl.rewards import math_verify as math_verify_reward

        corpus_row("math_verify", math_verify_reward, args.verbose)
        corpus_row("math-verify alone", plain_math_verify, args.verbose)

    print(f"\n{'adversarial input':40s} {'chars':>9s} {'seconds':>8s}")
    math_answer(["q"], ["#### 1"], ["1"])
    worst = 0.0
    for name, (response, _) in ADVERSARIAL.items():
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            math_answer(["q"], [response], ["72"], timeout_s=30.0)
            best = min(best, time.perf_counter() - start)
        worst = max(worst, best)
        print(f"{name:40s} {len(response):9d} {best:8.3f}")
    print(f"slowest adversarial input: {worst:.3f} s")


if __name__ == "__main__":
    main()
