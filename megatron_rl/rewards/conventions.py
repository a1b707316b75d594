"""Calling conventions of reward functions: which signature a function has, and how to call it.

* ``batch``: ``fn(prompts, responses, answers, **kwargs)`` returns one number per response (the
  trainer's own form; a ``@grader`` ``score(response, answer, **kwargs)`` resolves to one).
* ``verl``: verl's per-sample ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None, **kwargs)`` returns a float or a dict with a ``"score"`` key.  It is called by
  keyword, as verl calls it, with the record's ``data_source`` and ``extra_info``.

``reward.convention=auto`` tells them apart by parameter names (``solution_str`` and
``ground_truth`` make a verl function).  A signature that fits neither is refused when the
function is resolved, before launch, instead of failing with a TypeError on the first batch.
"""

from __future__ import annotations

import inspect
from typing import Optional

from megatron_rl.rewards.registration import RewardFn

# config/choices.py declares them as REWARD_CONVENTIONS; it is checked where they are resolved, not at import:
# the grading worker imports this module and must not import the config package.
AUTO, BATCH, VERL = "auto", "batch", "verl"
VERL_NAMES = ("solution_str", "ground_truth")
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
SUPPORTED = ("fn(prompts, responses, answers, **kwargs) (batch), score(response, answer, **kwargs) decorated "
             "with @megatron_rl.rewards.grader, or verl's compute_score(data_source, solution_str, ground_truth, "
             "extra_info=None) (verl); see docs/rewards.md")


class Misfit(ValueError):
    """The function does not fit the calling convention; the registry reports it as a one-line error."""

    def __init__(self, key: str, value, problem: str, fix: str):
        super().__init__(problem)
        self.key, self.value, self.problem, self.fix = key, value, problem, fix


def _parameters(fn) -> Optional[list[inspect.Parameter]]:
    """The parameters, or None when Python cannot tell (a builtin): then the function is trusted."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _accepts(params: list[inspect.Parameter], name: str) -> bool:
    return any(p.name == name and p.kind is not p.POSITIONAL_ONLY for p in params) or any(
        p.kind is p.VAR_KEYWORD for p in params)


def detect(fn: RewardFn) -> str:
    params = _parameters(fn)
    names = {p.name for p in params or ()}
    return VERL if all(n in names for n in VERL_NAMES) else BATCH


def _batch_misfit(params: list[inspect.Parameter], given: tuple) -> Optional[str]:
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for i, p in enumerate(positional) if p.default is p.empty and (i < 3 or p.name not in given)]
    takes_three = len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)
    if takes_three and len(required) <= 3:
        return None
    return (f"takes {len(positional)} positional parameter(s) ({len(required)} required), "
            "not (prompts, responses, answers)")


def _verl_misfit(params: list[inspect.Parameter], given: tuple) -> Optional[str]:
    missing = [n for n in VERL_NAMES if not _accepts(params, n)]
    if missing:
        return f"has no keyword parameter(s) {missing} of verl's compute_score"
    required = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                and p.name not in VERL_ARGUMENTS + given]
    return f"requires {required}, which verl's call does not pass" if required else None


def _signature(fn) -> str:
    try:
        return f"{getattr(fn, '__name__', type(fn).__name__)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def as_batch_reward(fn: RewardFn, convention: str, spec: str, given=()) -> RewardFn:
    """``fn`` as a batch reward under ``convention`` (``auto``: detected); :class:`Misfit` if it does not fit.

    ``given``: the names ``reward.kwargs`` passes, which may fill required parameters."""
    given = tuple(given)
    from megatron_rl.config.choices import REWARD_CONVENTIONS, require_same

    require_same((AUTO, BATCH, VERL), REWARD_CONVENTIONS, "reward calling conventions")
    if convention not in REWARD_CONVENTIONS:
        raise Misfit("reward.convention", convention, "unknown calling convention",
                     f"use one of {', '.join(REWARD_CONVENTIONS)}")
    params = _parameters(fn)
    if params is None:
        return fn
    chosen = detect(fn) if convention == AUTO else convention
    if chosen == VERL:
        problem = _verl_misfit(params, given)
    else:
        problem = _batch_misfit(params, given)
    if problem is not None:
        how = f"does not fit reward.convention={convention}" if convention != AUTO else "fits no calling convention"
        raise Misfit("reward.fn", spec, f"{_signature(fn)} {how}: it {problem}", f"write {SUPPORTED}")
    return VerlReward(fn, params) if chosen == VERL else fn


def _answer_required(param: Optional[inspect.Parameter]) -> bool:
    return param is None or param.default is param.empty


def needs_answers(fn: RewardFn) -> bool:
    """Whether ``fn`` reads reference answers: its ``needs_answers`` attribute, else a grader's or a
    verl function's answer parameter without a default, else True (a batch function may read them)."""
    explicit = getattr(fn, "needs_answers", None)
    if explicit is not None:
        return bool(explicit)
    grader = getattr(fn, "grader", None)
    if grader is not None:
        params = [p for p in _parameters(grader) or () if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return _answer_required(params[1] if len(params) > 1 else None)
    return True


class VerlReward:
    """A verl ``compute_score`` as a batch reward: called per sample by keyword; a dict result gives its "score".

    ``takes_fields``: the trainer passes each sample's record fields (``data_source``,
    ``extra_info``) as ``fields=[...]``; a missing one is passed as None, as verl would."""

    takes_fields = True

    def __init__(self, fn: RewardFn, params: list[inspect.Parameter]):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__module__ = getattr(fn, "__module__", None)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.passes = tuple(n for n in ("data_source", "extra_info") if _accepts(params, n))
        self.needs_answers = _answer_required(next((p for p in params if p.name == "ground_truth"), None))

    def __call__(self, prompts, responses, answers, fields=None, **kwargs) -> list:
        fields = list(fields) if fields is not None else [{}] * len(responses)
        out = []
        for response, answer, record in zip(responses, answers, fields):
            passed = {name: record.get(name) for name in self.passes}
            value = self.fn(solution_str=response, ground_truth=answer, **passed, **kwargs)
            out.append(value["score"] if isinstance(value, dict) and "score" in value else value)
        return out
