"""Per-sample graders: one response and its reference in, one score out.

These are what the bounded worker process runs (:mod:`megatron_rl.rewards.bounded`), so this
module and what it imports stay free of torch: a worker that is replaced after a timeout starts in
a fraction of a second.  The batch reward functions built on them are registered in
:mod:`megatron_rl.rewards.math_answer` and :mod:`megatron_rl.rewards.format`.
"""

from __future__ import annotations

from megatron_rl.rewards.compare import group_matches
from megatron_rl.rewards.extract import UNREADABLE, _scan_hashes, final_answer, last_group, reference_answer
from megatron_rl.rewards.latex import canonical
from megatron_rl.rewards.numbers import read_number

CORRECT_WEIGHT = 0.9
FORMAT_WEIGHT = 0.1


def is_correct(response: str, answer) -> bool:
    """Whether the final answer of ``response`` is the reference ``answer`` (bare, or a full solution)."""
    found = final_answer(response)
    return found is not None and group_matches(found.parts, reference_answer(answer))


def has_final_answer(response: str) -> bool:
    """True if ``response`` ends with ``#### <number>`` or has a non-empty ``\\boxed{...}``."""
    if not isinstance(response, str):
        raise TypeError(f"a response must be a str, got {type(response).__name__}")
    boxed = last_group(response)
    if boxed is not None and boxed.source == UNREADABLE:
        return False
    if boxed is not None and any(part.strip() for part in boxed.parts):
        return True
    hashes, _ = _scan_hashes(response)
    if hashes is None:
        return False
    line_end = response.find("\n", hashes.position)
    ends = line_end < 0 or not response[line_end:].strip()
    return ends and read_number(canonical(hashes.parts[0]).text) is not None


def score_math_answer(response: str, answer, **kwargs) -> float:
    """1.0 when the response's final answer equals the reference, else 0.0."""
    return 1.0 if is_correct(response, answer) else 0.0


def score_format(response: str, answer=None, **kwargs) -> float:
    """1.0 when the response has a well-formed final answer (see :func:`has_final_answer`)."""
    return 1.0 if has_final_answer(response) else 0.0


def score_math_answer_with_format(response: str, answer, correct_weight: float = CORRECT_WEIGHT,
                                  format_weight: float = FORMAT_WEIGHT, **kwargs) -> float:
    """``correct_weight * correct + format_weight * well_formed``."""
    return correct_weight * float(is_correct(response, answer)) + format_weight * float(has_final_answer(response))
