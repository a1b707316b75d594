"""Does the response take its final answer back?  ``\\boxed{12} is incorrect`` answers nothing.

A policy paid for an answer it then calls wrong learns to write answers it does not stand by, so a
final answer is no answer when:

* the words right after it give a negative verdict: ``\\boxed{12} is incorrect``, ``#### 12 is wrong``;
* later text gives one on it: ``that's wrong``, ``this answer is not correct``, ``I made a mistake``,
  ``scratch that``, ``never mind``, ``no, wait``;
* it is denied: ``the answer is not \\boxed{12}``;
* later text states another one: ``the answer should be 14`` after ``\\boxed{12}``.

The patterns need a verdict on the answer (a subject such as *that*, *it*, *the answer*), not the
bare words *wrong* or *mistake*, so ``A common mistake is to forget May`` and ``that is not wrong``
keep the answer.  A later box or ``####`` line is a new final answer and is checked on its own.
Only the first :data:`MAX_TAIL` characters after the answer are read (a retraction follows the
answer, and the bound keeps a response with a megabyte after its box at a few milliseconds); the
patterns have no nested repetition, so each is linear in what it reads.
"""

from __future__ import annotations

import re
from typing import Callable

_VERDICT = (r"(?:wrong|incorrect|mistaken|erroneous|a\s+mistake|an\s+error"
            r"|not\s+(?:right|correct|true|the\s+(?:right\s+|correct\s+|final\s+)?answer))\b")
_ADVERB = r"(?:(?:definitely|clearly|obviously|actually|totally|completely|simply|just|probably|also|still)\s+)?"
_BE = r"(?:is|was|'s|seems|seemed|looks|looked|must\s+be|would\s+be)"
_SUBJECT = r"(?:that|this|it|which|above|(?:the|my|this|that|our)\s+(?:\w+\s+)?(?:answer|result|value|box|solution))"

_RIGHT_AFTER = re.compile(r"\A[\s$.,:;)\]*_]{0,8}" + _BE + r"\s+" + _ADVERB + _VERDICT, re.I)
# Not after "if"/"whether": "let me know if I made a mistake" is no verdict.
_LATER = re.compile(
    r"\b(?<!if\s)(?<!whether\s)(?:" + _SUBJECT + r"\s*" + _BE + r"\s+" + _ADVERB + _VERDICT
    + r"|" + _SUBJECT + r"\s*(?:isn't|wasn't)\s+(?:right|correct|true)\b"
    + r"|(?:i|we)(?:'ve|\s+have)?\s+made\s+(?:a|an)\s+(?:\w+\s+)?(?:mistake|error)\b"
    + r"|scratch\s+that|never\s*mind|i\s+retract|can'?t\s+be\s+right|no,?\s+wait\b|wait,?\s+no\b|oops\b)",
    re.I)
_DENIED = re.compile(r"\b(?:not|isn't|never)[\s$*_(]*\Z", re.I)
# A number or expression stated as the answer after the final one: ``the answer should be 14``.
_RESTATED = re.compile(r"\b(?:answer|result)\s+(?:should|would|must)\s+(?:be|have\s+been)\s*:?\s*"
                       r"([-+$\\\d][^\n;!?]{0,80})", re.I)
_BEFORE = 24  # characters before the answer looked at for a denial
MAX_TAIL = 10_000  # characters after the answer looked at for a retraction


def retracted(text: str, start: int, end: int, same_answer: Callable[[str], bool]) -> bool:
    """Whether the answer written in ``text[start:end]`` is taken back (see the module docstring).

    ``same_answer(other)`` says whether ``other``, an answer stated later in prose, is the final answer."""
    tail = text[end:end + MAX_TAIL].replace("\u2019", "'")
    if _RIGHT_AFTER.search(tail) or _LATER.search(tail):
        return True
    if _DENIED.search(text[max(0, start - _BEFORE):start].replace("\u2019", "'")):
        return True
    for match in _RESTATED.finditer(tail):
        restated = re.split(r"\.(?:\s|$)", match.group(1), maxsplit=1)[0].strip()
        if restated and not same_answer(restated):
            return True
    return False
