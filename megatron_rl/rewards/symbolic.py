"""The ``math_verify`` grader: this package's extraction, math-verify's symbolic comparison.

math-verify (Hugging Face, the ``.[math]`` extra) compares answers with SymPy, so it accepts
equivalences the exact grader cannot read (``\\sin^2x+\\cos^2x`` = 1, unions of intervals).  Its own
extraction ignores the ``####`` contract, treats several boxes as a set and reads ``1e3`` as 1, and
its timeouts use ``signal.alarm`` (main thread only), so here:

* the final answer is found by :mod:`megatron_rl.rewards.extract` (same contract and box policy as
  ``math_answer``) and handed to math-verify as canonical LaTeX;
* an answer the exact grader accepts scores 1 without SymPy; two plain numbers are decided by the
  exact grader alone (math-verify rounds floats to 6 places), and so are answers whose symbols
  differ only in case (latex2sympy lower-cases symbols: it equates ``X+1`` and ``x+1``);
* math-verify sees every decimal as the exact fraction it writes (``3.1415927`` as
  ``\\frac{31415927}{10000000}``), so it compares exactly: a rounded decimal is never ``\\pi``,
  ``\\sqrt{2}`` or ``\\sin(\\pi/3)``, and ``0.5`` still equals ``\\sin(\\pi/6)``;
* math-verify runs with its signal timeouts off; the bound is the worker process of
  :mod:`megatron_rl.rewards.bounded`, which works on any thread.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

from megatron_rl.rewards.compare import group_matches
from megatron_rl.rewards.extract import final_answer, reference_answer
from megatron_rl.rewards.latex import _TOKEN, canonical
from megatron_rl.rewards.numbers import read_number

_MATH_VERIFY = None


def load_math_verify():
    """The math_verify module, with its signal-free settings (ImportError says how to install it)."""
    global _MATH_VERIFY
    if _MATH_VERIFY is None:
        try:
            import math_verify
        except ImportError as err:
            raise ImportError("reward.fn=math_verify needs the math-verify package: "
                              "pip install 'megatron_rl[math]' (or pip install 'math-verify[antlr4_13_2]')") from err
        for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.utils"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # "timeout disabled" warnings: the bound is ours
        _MATH_VERIFY = math_verify
    return _MATH_VERIFY


# A finite decimal not followed by more digits, a repeating bar or an exponent (those are left alone).
_DECIMAL = re.compile(r"(?<![\d.])(\d+)\.(\d+)(?![\d.]|\\overline|[eE][-+]?\d)")


def exact_decimals(latex: str) -> str:
    """Each decimal of ``latex`` written as a fraction (``2.25`` -> ``\\frac{225}{100}``)."""
    def fraction(m: re.Match) -> str:
        numerator = (m.group(1) + m.group(2)).lstrip("0") or "0"
        return rf"\frac{{{numerator}}}{{1{'0' * len(m.group(2))}}}"

    return _DECIMAL.sub(fraction, latex)


def _parse(text: str):
    mv = load_math_verify()
    latex = exact_decimals(canonical(text).text)
    return mv.parse(f"${latex}$", extraction_config=[mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
                    parsing_timeout=None)


def symbolic_match(predicted: str, reference: str) -> bool:
    """math-verify's verdict on two bare answers (no signals, no timeout of its own)."""
    gold, pred = _parse(reference), _parse(predicted)
    if not gold or not pred:
        return False
    return bool(load_math_verify().verify(gold, pred, timeout_seconds=None))


def _symbols(text: str) -> set[str]:
    """Letters and command names of a canonical answer, case kept."""
    out = set()
    for tok in _TOKEN.findall(text):
        if (tok.startswith("\\") and tok[1:].isalpha()) or (len(tok) == 1 and tok.isalpha()):
            out.add(tok)
    return out


def case_clash(predicted: str, reference: str) -> bool:
    """The two answers use different symbols, and some two of all their symbols differ only in case
    (``X`` and ``x``, ``\\Pi`` and ``\\pi``).  latex2sympy lower-cases symbols, so math-verify would
    equate such answers."""
    a, b = _symbols(canonical(predicted).text), _symbols(canonical(reference).text)
    both = a | b
    return a != b and len({s.lower() for s in both}) < len(both)


def _both_numbers(predicted: str, reference: str) -> bool:
    return read_number(canonical(predicted).text) is not None and read_number(canonical(reference).text) is not None


def verify_answer(parts: tuple[str, ...], reference: Optional[str]) -> bool:
    """Exact grader first; math-verify for what it cannot decide (see the module docstring)."""
    if reference is None or not parts:
        return False
    if group_matches(parts, reference):
        return True
    distinct = dict.fromkeys(parts)
    return all(not _both_numbers(p, reference) and not case_clash(p, reference) and symbolic_match(p, reference)
               for p in distinct)


def score_math_verify(response: str, answer, **kwargs) -> float:
    """1.0 when the final answer equals the reference exactly or symbolically, else 0.0."""
    found = final_answer(response)
    return 1.0 if found is not None and verify_answer(found.parts, reference_answer(answer)) else 0.0


score_math_verify.prepare = load_math_verify
