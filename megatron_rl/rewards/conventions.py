"""Calling conventions of reward functions: which signature a function has, and how to call it.

* ``batch``: ``fn(prompts, responses, answers, **kwargs)`` returns one number per response (the
  trainer's own form; a ``@grader`` ``score(response, answer, **kwargs)`` resolves to one).  The three
  are passed by position, so their names must say what they receive (:data:`BATCH_NAMES`).
* ``verl``: verl's per-sample ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None, **kwargs)`` returns a float or a dict with a ``"score"`` key.  It is called by
  keyword, as verl calls it, with the record's ``data_source`` and ``extra_info``.
* ``trl``: TRL's ``fn(prompts, completions, completion_ids, **kwargs)`` returns one number (or None)
  per completion.  It is called by keyword, as TRL's GRPOTrainer calls it, with every dataset column
  of the records as a list by column name.

``reward.convention=auto`` tells them apart by parameter names (``solution_str`` and
``ground_truth`` make a verl function, ``completions`` a TRL one).  A signature that fits none is
refused when the function is resolved, before launch, instead of failing with a TypeError on the
first batch, or worse, binding the wrong lists to its parameters.  Every convention gets the
dataset columns it names (:mod:`megatron_rl.rewards.columns`).
"""

from __future__ import annotations

import inspect
from typing import Optional, Sequence

from megatron_rl.rewards import columns
from megatron_rl.rewards.registration import RewardFn

# config/choices.py declares them as REWARD_CONVENTIONS; it is checked where they are resolved, not at import:
# the grading worker imports this module and must not import the config package.
AUTO, BATCH, VERL, TRL = "auto", "batch", "verl", "trl"
VERL_NAMES = ("solution_str", "ground_truth")
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_NAME = "completions"
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")
# What TRL passes besides the dataset columns and what it leaves out of them.
TRL_STATE, TRL_NOT_COLUMNS = "trainer_state", ("prompt", "completion", "completion_ids")
# The names a batch function's three positional parameters may have (a leading "_" is ignored).
BATCH_NAMES = (("prompts", "prompt", "queries", "questions", "inputs"),
               ("responses", "response", "outputs", "generations", "texts"),
               ("answers", "answer", "references", "ground_truths", "targets", "labels"))
SUPPORTED = ("fn(prompts, responses, answers, **kwargs) (batch), score(response, answer, **kwargs) decorated "
             "with @megatron_rl.rewards.grader, verl's compute_score(data_source, solution_str, ground_truth, "
             "extra_info=None) (verl), or TRL's fn(completions, **kwargs) (trl); see docs/rewards.md")


class Misfit(ValueError):
    """The function does not fit the calling convention; the registry reports it as a one-line error."""

    def __init__(self, key: str, value, problem: str, fix: str):
        super().__init__(problem)
        self.key, self.value, self.problem, self.fix = key, value, problem, fix


_parameters = columns.parameters
_accepts = columns.takes_keyword


def _named(params: Sequence[inspect.Parameter], name: str) -> bool:
    """A parameter of that very name (``**kwargs`` does not count: detection goes by names)."""
    return any(p.name == name and p.kind is not p.POSITIONAL_ONLY for p in params)


def detect(fn: RewardFn) -> str:
    params = _parameters(fn) or []
    if all(_named(params, n) for n in VERL_NAMES):
        return VERL
    return TRL if _named(params, TRL_NAME) else BATCH


def _required_extra(params: Sequence[inspect.Parameter], passed: tuple) -> list[str]:
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and p.name not in passed]


def _batch_misfit(params: list[inspect.Parameter], given: tuple) -> Optional[str]:
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for i, p in enumerate(positional) if p.default is p.empty and (i < 3 or p.name not in given)]
    takes_three = len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)
    if not (takes_three and len(required) <= 3):
        return (f"takes {len(positional)} positional parameter(s) ({len(required)} required), "
                "not (prompts, responses, answers)")
    names = [p.name for p in positional[:3]]
    if all(name.lstrip("_") in allowed for name, allowed in zip(names, BATCH_NAMES)):
        return None
    return (f"names its positional parameters ({', '.join(names)}), which a positional call would bind to "
            "(prompts, responses, answers)")


def _verl_misfit(params: list[inspect.Parameter], given: tuple) -> Optional[str]:
    missing = [n for n in VERL_NAMES if not _accepts(params, n)]
    if missing:
        return f"has no keyword parameter(s) {missing} of verl's compute_score"
    required = _required_extra(params, VERL_ARGUMENTS + given)
    return f"requires {required}, which verl's call does not pass" if required else None


def _trl_misfit(params: list[inspect.Parameter], given: tuple) -> Optional[str]:
    if not _accepts(params, TRL_NAME):
        return f"has no keyword parameter '{TRL_NAME}' of TRL's reward functions"
    if any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in params):
        return "has positional-only parameters, and TRL's call passes everything by keyword"
    if TRL_STATE in _required_extra(params, given):
        return (f"requires '{TRL_STATE}' (TRL's transformers TrainerState), which has no counterpart here; "
                f"give it a default ({TRL_STATE}=None)")
    return None


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

    require_same((AUTO, BATCH, VERL, TRL), REWARD_CONVENTIONS, "reward calling conventions")
    if convention not in REWARD_CONVENTIONS:
        raise Misfit("reward.convention", convention, "unknown calling convention",
                     f"use one of {', '.join(REWARD_CONVENTIONS)}")
    params = _parameters(fn)
    if params is None:
        return fn
    chosen = detect(fn) if convention == AUTO else convention
    problem = {VERL: _verl_misfit, TRL: _trl_misfit, BATCH: _batch_misfit}[chosen](params, given)
    if problem is not None:
        how = f"does not fit reward.convention={convention}" if convention != AUTO else "fits no calling convention"
        raise Misfit("reward.fn", spec, f"{_signature(fn)} {how}: it {problem}", f"write {SUPPORTED}")
    if chosen == VERL:
        return VerlReward(fn, params)
    return TrlReward(fn, params, given) if chosen == TRL else fn


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


def _named_like(wrapper, fn: RewardFn) -> None:
    """Messages name the user's function, not the wrapper that calls it."""
    wrapper.fn = fn
    wrapper.__name__ = getattr(fn, "__name__", type(fn).__name__)
    wrapper.__qualname__ = getattr(fn, "__qualname__", wrapper.__name__)
    wrapper.__module__ = getattr(fn, "__module__", None)
    wrapper.__doc__ = getattr(fn, "__doc__", None)


class VerlReward:
    """A verl ``compute_score`` as a batch reward: called per sample by keyword; a dict result gives its "score".

    ``takes_fields``: the trainer passes each sample's record (its dataset columns) as
    ``fields=[...]``; ``data_source`` and ``extra_info`` are read from it, None when missing, as verl
    would pass them."""

    takes_fields = True

    def __init__(self, fn: RewardFn, params: list[inspect.Parameter]):
        _named_like(self, fn)
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


class NoReward(list):
    """A TRL function's scores with None read as 0, and how many were None."""

    def __init__(self, values, no_reward: int):
        super().__init__(values)
        self.no_reward = no_reward


def _chat(value) -> Optional[list]:
    """``value`` when it is a list of ``{"role", "content"}`` messages (TRL's conversational rule), else None."""
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                  for m in value):
        return value
    return None


class TrlReward:
    """A TRL reward function as a batch reward, called once per batch by keyword as GRPOTrainer calls it.

    ``prompts``: the records' ``prompt`` column when it is a chat (conversational data), else the prompt
    text; ``completions``: the response texts, or ``[{"role": "assistant", "content": text}]`` each for
    conversational data; ``completion_ids``: the response token ids; every other dataset column as a
    list by its name.  A parameter it does not accept is not passed (TRL passes them all to
    ``**kwargs``); ``trainer_state`` is never passed.  A None score (TRL: "no reward from this
    function") counts as 0, and how many there were is reported (``no_reward``)."""

    takes_fields = True
    takes_completion_ids = True
    needs_answers = False

    def __init__(self, fn: RewardFn, params: list[inspect.Parameter], given: tuple = ()):
        _named_like(self, fn)
        self.params = params
        self.passes = tuple(n for n in TRL_ARGUMENTS if columns.takes_keyword(params, n))
        self.required_columns = tuple(n for n in _required_extra(params, TRL_ARGUMENTS + tuple(given)))
        self.skip = frozenset(TRL_ARGUMENTS + TRL_NOT_COLUMNS + (TRL_STATE,))

    def __call__(self, prompts, responses, answers, fields=None, completion_ids=None, **kwargs) -> NoReward:
        records = list(fields) if fields is not None else [{} for _ in responses]
        chats = [_chat(record.get("prompt")) for record in records]
        conversational = any(chat is not None for chat in chats)
        arguments = {
            "prompts": [chat if chat is not None else text for chat, text in zip(chats, prompts)],
            "completions": ([[{"role": "assistant", "content": r}] for r in responses] if conversational
                            else list(responses)),
            "completion_ids": None if completion_ids is None else [[int(t) for t in ids] for ids in completion_ids],
        }
        call = {name: arguments[name] for name in self.passes if arguments[name] is not None}
        call.update(columns.as_lists(self.params, records, self.skip | set(kwargs)))
        out = self.fn(**call, **kwargs)
        if not isinstance(out, (list, tuple)):
            return out  # the registry's check names what came back
        return NoReward([0.0 if value is None else value for value in out], sum(value is None for value in out))
