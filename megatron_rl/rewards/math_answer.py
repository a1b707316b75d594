"""Verifiable math rewards: is the response's final answer equal to the reference?

Policy models write the same number many ways (``$1,000``, ``1000.0``, ``\\frac{3}{4}`` vs
``0.75``); counting those as wrong would teach formatting, not arithmetic.  So answers are
extracted (GSM8K ``#### x`` or LaTeX ``\\boxed{x}``, whichever comes last), normalised and, when
both sides are numbers, compared numerically with a relative tolerance of 1e-6.  Anything that is
not a number is compared as text with whitespace removed and case folded.
"""

from __future__ import annotations

import math
import re
from typing import Optional

from megatron_rl.rewards.registry import register_reward

REL_TOL = 1e-6

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FLOAT = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$")
_FRAC = re.compile(r"^([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")


def last_boxed(text: str) -> Optional[tuple[int, str]]:
    """``(position, contents)`` of the last ``\\boxed{...}`` with balanced braces, else None."""
    found = None
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found = (match.start(), text[start:i])
                break
    return found


def last_hashes(text: str) -> Optional[tuple[int, str]]:
    """``(position, rest of line)`` after the last GSM8K ``####`` marker, else None."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    rest = text[pos + 4:].split("\n", 1)[0].strip()
    return (pos, rest) if rest else None


def extract_answer(text: str) -> Optional[str]:
    """The final answer of ``text``: the later of its last ``#### x`` and last ``\\boxed{x}``."""
    candidates = [c for c in (last_hashes(text), last_boxed(text)) if c is not None and c[1].strip()]
    return max(candidates)[1].strip() if candidates else None


def reference_answer(answer) -> Optional[str]:
    """The reference as a bare answer: GSM8K solutions (``...#### 72``) are reduced to ``72``."""
    if answer is None:
        return None
    text = str(answer)
    if "####" in text or _BOXED.search(text):
        return extract_answer(text)
    return text.strip() or None


def _strip_latex(text: str) -> str:
    text = text.replace("\u2212", "-")
    for _ in range(3):  # \text{\textbf{x}} nests a little
        text = _TEXT.sub(r"\1", text)
    for token in ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\left", "\\right", "\\$", "$"):
        text = text.replace(token, "")
    text = text.replace("{,}", ",").replace("\\%", "%").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.strip().rstrip(".").strip()
    while _wrapped_in_braces(text):
        text = text[1:-1].strip()
    return text


def _wrapped_in_braces(text: str) -> bool:
    if not (text.startswith("{") and text.endswith("}")):
        return False
    depth = 0
    for i, ch in enumerate(text):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return i == len(text) - 1
    return False


def _plain_number(text: str) -> Optional[float]:
    text = _THOUSANDS.sub("", text)
    return float(text) if _FLOAT.match(text) else None


def parse_number(text: str) -> Optional[float]:
    """A float for ``72``, ``-1,234.50``, ``$5``, ``+3``, ``50%``, ``3/4``, ``\\frac{3}{4}``; else None."""
    text = re.sub(r"\s+", "", _strip_latex(text))
    text = text[:-1] if text.endswith("%") else text
    match = _FRAC.match(text)
    if match:
        sign, num, den = match.group(1), _plain_number(match.group(2)), _plain_number(match.group(3))
    elif text.count("/") == 1:
        sign = ""
        num, den = (_plain_number(part) for part in text.split("/"))
    else:
        return _plain_number(text)
    if num is None or den is None or den == 0:
        return None
    return (-1.0 if sign == "-" else 1.0) * num / den


def normalize_text(text: str) -> str:
    """Non-numeric answers: LaTeX spacing and ``\\text{}`` removed, no whitespace, case folded."""
    return re.sub(r"\s+", "", _strip_latex(text)).casefold()


def answers_match(predicted: Optional[str], reference: Optional[str]) -> bool:
    """Numeric equality (relative tolerance 1e-6) when both parse as numbers, else text equality."""
    if predicted is None or reference is None:
        return False
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=REL_TOL)
    return normalize_text(predicted) == normalize_text(reference) != ""


def is_correct(response: str, answer) -> bool:
    """Whether the final answer of ``response`` equals the reference ``answer``."""
    return answers_match(extract_answer(response), reference_answer(answer))


@register_reward("math_answer", "gsm8k")
def math_answer(prompts, responses, answers, **kwargs) -> list[float]:
    """1.0 where the response's final answer equals the reference, else 0.0 (no answer: 0.0)."""
    return [1.0 if is_correct(r, a) else 0.0 for r, a in zip(responses, answers)]


@register_reward("exact_match")
def exact_match(prompts, responses, answers, **kwargs) -> list[float]:
    """1.0 where the whole response equals the reference after strip and casefold, else 0.0."""
    return [1.0 if a is not None and r.strip().casefold() == str(a).strip().casefold() else 0.0
            for r, a in zip(responses, answers)]
