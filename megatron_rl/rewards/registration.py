"""How a reward function becomes resolvable by name: the decorators the built-in reward modules
(and plugins) use.  A leaf: :mod:`megatron_rl.rewards.registry` imports the built-in modules to list
and resolve them, and they import this."""

from __future__ import annotations

from typing import Callable, Optional

from megatron_rl.rewards import columns
from megatron_rl.rewards.bounded import DEFAULT_TIMEOUT_S, Scores, bounded_map
from megatron_rl.rewards.locations import file_of_module

RewardFn = Callable[..., object]

_REWARDS: dict[str, RewardFn] = {}
_NAMES: dict[RewardFn, str] = {}  # fn -> the name it was first registered under


def register_reward(name: str, *aliases: str):
    """Decorator: make ``fn`` resolvable by ``name`` (and any ``aliases``) in ``reward.fn``."""

    def decorator(fn: RewardFn) -> RewardFn:
        for key in (name, *aliases):
            old = _REWARDS.get(key)
            # Re-registering the same function (a reloaded module) is fine; a different one is a clash.
            if old is not None and _qualified(old) != _qualified(fn):
                raise ValueError(f"reward name {key!r} is already registered to {reward_name(old)}")
            _REWARDS[key] = fn
        _NAMES.setdefault(fn, name)
        return fn

    return decorator


def batch_reward(score: RewardFn, name: Optional[str] = None, module: Optional[str] = None) -> RewardFn:
    """The batch reward of a per-sample grader ``score(response, answer, **kwargs) -> float``.

    It returns :class:`Scores` (a list that also counts timed-out samples) and takes three keyword
    arguments of its own: ``timeout_s`` (per sample; None grades in-process, unbounded),
    ``grading_workers`` (child processes grading at once, default 1) and ``fields`` (each sample's
    record: the dataset columns ``score`` names, or all of them for ``**kwargs``, reach it per sample).
    ``name`` and ``module`` say where the batch function is bound, so that it pickles by reference."""
    params = columns.parameters(score) or []
    own = columns.positional_names(params, 2)

    def reward(prompts, responses, answers, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S,
               grading_workers: int = 1, fields: Optional[list] = None, **kwargs) -> Scores:
        for response in responses:
            if not isinstance(response, str):
                raise TypeError(f"a response must be a str, got {type(response).__name__}")
        per_sample = columns.per_record(params, fields, set(own) | set(kwargs)) if fields is not None else None
        return bounded_map(score, list(zip(responses, answers)), kwargs, timeout_s, grading_workers, per_sample)

    reward.__name__ = reward.__qualname__ = name or score.__name__
    reward.__module__ = module or score.__module__
    reward.__doc__ = score.__doc__
    reward.bounded = True
    reward.takes_fields = True
    reward.grader = score
    score.batch_reward = reward
    return reward


def grader(score: RewardFn) -> RewardFn:
    """Decorator: mark a module-level ``score(response, answer, **kwargs) -> float`` as a grader, so
    ``reward.fn: package.module:score`` resolves to its bounded batch reward.

    The function itself is returned unchanged: the worker process imports it by module and name."""
    batch_reward(score)
    return score


def register_grader(name: str, *aliases: str):
    """Decorator: :func:`grader`, and register its batch reward under ``name`` (and ``aliases``)."""

    def decorator(score: RewardFn) -> RewardFn:
        register_reward(name, *aliases)(batch_reward(score, name))
        return score

    return decorator


def _qualified(fn: RewardFn) -> str:
    """``module:qualname`` (``path.py:qualname`` for a reward file imported by its path), else the repr."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{file_of_module(module) or module}:{qualname}" if module and qualname else repr(fn)


def reward_name(fn: RewardFn) -> str:
    """The name used in messages: the registered name, else ``module:qualname``."""
    try:
        return _NAMES.get(fn) or _qualified(fn)
    except TypeError:  # an unhashable callable object
        return _qualified(fn)
