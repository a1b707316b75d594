"""The environment protocol and the registry ``rollout.env`` names.

A trajectory starts from a prompt record; the policy takes a turn (tokens up to EOS, the
environment's stop strings or the turn's token limit); the environment answers with the next
observation, a reward and whether the trajectory is done.  One environment object serves one
trajectory: :func:`environment_factory` returns the callable that builds them
(``cls(**rollout.env_kwargs)``), so an environment may keep per-trajectory state in ``self``.

An observation is text (tokenized once with the tokenizer's ``encode``, no BOS, and appended) or
token ids (appended as they are): the conversation is never re-tokenized, so the trainer trains on
exactly the ids the engine generated, with the observation's ids masked out of the loss.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, Protocol, Sequence, Union, runtime_checkable

from megatron_rl.errors import ConfigError
from megatron_rl.rewards.locations import import_spec

KEY = "rollout.env"


@dataclasses.dataclass
class Turn:
    """What an environment returns after one policy turn."""

    observation: Union[str, Sequence[int]] = ""  # appended after the policy's turn (no loss on it)
    reward: float = 0.0  # added to the trajectory's score (with reward.fn's grade of the last turn)
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)  # counted into env/* metrics when numeric


@runtime_checkable
class Environment(Protocol):
    """What ``rollout.env=module:Class`` must provide (one instance per trajectory)."""

    # Strings that end a policy turn besides EOS, e.g. "</tool_call>"; kept in the turn.
    stop: Sequence[str]

    def reset(self, record: dict) -> None:
        """Start a trajectory; ``record`` has ``prompt`` and ``answer`` and the prompt record's
        ``data_source`` / ``extra_info`` when it has them."""

    def step(self, turn_text: str, turn_ids: Sequence[int]) -> Turn:
        """The environment's answer to the policy's turn (its decoded text and token ids)."""


def observation_ids(observation: Union[str, Sequence[int]], encode: Callable[[str], list[int]]) -> list[int]:
    """The ids an observation appends: text encoded once (no BOS), ids as they are."""
    return encode(observation) if isinstance(observation, str) else [int(i) for i in observation]


# Built-in environments: name -> "module:Class" (imported when used).
ENVIRONMENTS = {
    "tool_calling": "megatron_rl.envs.tool_env:ToolCallingEnv",
}


def import_for(key: str, spec: str, shown: str | None = None):
    """The object ``"package.module:qualname"`` names, or a one-line :class:`ConfigError` naming
    ``key`` (with the value the user wrote, ``shown``)."""
    try:
        return import_spec(spec)
    except (ImportError, AttributeError) as err:
        raise ConfigError(key, spec if shown is None else shown, f"cannot import it ({type(err).__name__}: {err})",
                          "put the module on PYTHONPATH or in the working directory") from None


def environment_factory(spec: str, kwargs: dict | None = None,
                        defaults: dict | None = None) -> Callable[[], Environment]:
    """The callable that builds one environment per trajectory for ``rollout.env=spec``.

    ``defaults`` (``{"timeout_s": rollout.tool_timeout_s}``) go to a constructor that takes them by
    name, unless ``kwargs`` sets them.

    Raises a one-line :class:`ConfigError` naming ``rollout.env`` (or ``rollout.env_kwargs``) when
    the spec cannot be imported, is not a class with ``reset`` and ``step``, or its constructor does
    not take the keyword arguments; one environment is built here, so that is known before launch."""
    kwargs = dict(kwargs or {})
    target = ENVIRONMENTS.get(spec, spec)
    if ":" not in target:
        raise ConfigError(KEY, spec, "not a built-in environment and not 'module:Class'",
                          f"use one of {', '.join(ENVIRONMENTS)} or 'package.module:Class'")
    cls = import_for(KEY, target, shown=spec)
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise ConfigError(KEY, spec, "not a class with reset(record) and step(turn_text, turn_ids) methods",
                          "point rollout.env at an environment class (docs/environments.md)")
    accepted = inspect.signature(cls).parameters
    for name, value in (defaults or {}).items():
        if name in accepted and name not in kwargs:
            kwargs[name] = value
    try:
        probe = cls(**kwargs)
    except TypeError as err:
        raise ConfigError("rollout.env_kwargs", kwargs, f"{spec} does not take them ({err})",
                          f"pass only the keyword arguments {cls.__name__}() accepts") from None
    stop = getattr(probe, "stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(KEY, spec, f"its stop attribute {stop!r} is not a list of non-empty strings",
                          "set stop = ['</tool_call>'] (or ()) on the class")
    return lambda: cls(**kwargs)
