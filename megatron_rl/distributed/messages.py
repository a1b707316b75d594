"""The messages between trainer rank 0 and generator rank 0, one frozen dataclass per kind.

Every message travels as one JSON object with its ``kind`` and the ``protocol`` it was written
in (:func:`encode`); :func:`decode` checks each on receipt (known kind, this protocol, every field
present with its type, no field unknown) and raises :class:`MessageError` naming the kind and
the field, so a message from a mismatched or broken peer stops the job at the message, not later
at some use of a field.  Plain data only: nothing received is unpickled.  Kept free of the
rollout and trainer packages so that both sides import it.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Optional, Union

PROTOCOL = 2  # raise when a message's fields change: both worlds run the same code or stop


class MessageError(ValueError):
    """A malformed message: ``kind`` (as far as known) and ``field`` name what is wrong."""

    def __init__(self, kind: str, field: str, problem: str):
        super().__init__(f"malformed {kind!r} message: field {field!r} {problem}")
        self.kind, self.field = kind, field


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How the requests that follow are sampled (:class:`~megatron_rl.rollout.sampling.SamplingParams` fields)."""

    sampling: dict
    kind: typing.ClassVar[str] = "settings"


@dataclasses.dataclass(frozen=True)
class WeightsPush:
    """The actor's weights after ``version`` updates follow, rank to rank (not through the store);
    ``adapters_only``: the LoRA adapters alone (the generators hold the frozen base from a full push)."""

    version: int
    adapters_only: bool = False
    kind: typing.ClassVar[str] = "weights"


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """Generate batch ``step``: its prompts, its seed, and (multi-turn) what its environments start from."""

    step: int
    prompt_ids: list
    seed: int
    records: Optional[list] = None
    kind: typing.ClassVar[str] = "request"


@dataclasses.dataclass(frozen=True)
class Stop:
    """Stop once every message before this one has been acted on."""

    kind: typing.ClassVar[str] = "stop"


@dataclasses.dataclass(frozen=True)
class GeneratedRollout:
    """A generated batch's samples (:class:`~megatron_rl.rollout.engine.RolloutBatch` without routing);
    ``prompt_ids``, ``response_mask`` and ``env_info`` come back from multi-turn rollouts only."""

    prompt_index: list
    response_ids: list
    response_logprobs: list
    finish_reason: list
    token_versions: Optional[list] = None
    prompt_ids: Optional[list] = None
    response_mask: Optional[list] = None
    env_info: Optional[list] = None


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """A requested batch, the policy version that generated it, and what it cost the generators."""

    rollout: GeneratedRollout
    version: int
    generate_s: float
    idle_s: float  # the generators' wait for the request
    refit_s: float  # the last weight push's
    refit_bytes: int
    shard_bytes: int
    kind: typing.ClassVar[str] = "result"


TRAINER_MESSAGES = (SamplingSettings, WeightsPush, GenerationRequest, Stop)  # the ordered stream to the generators
Message = Union[SamplingSettings, WeightsPush, GenerationRequest, Stop, GenerationResult]
_KINDS = {cls.kind: cls for cls in (*TRAINER_MESSAGES, GenerationResult)}


def to_wire(message) -> dict:
    """``message`` as JSON-ready plain data, with its kind and protocol."""
    return {"kind": message.kind, "protocol": PROTOCOL, **_plain(message)}


def from_wire(data, expect: Optional[tuple] = None):
    """The message ``data`` holds, checked; ``expect``: the kinds acceptable here (default any)."""
    if not isinstance(data, dict):
        raise MessageError("?", "kind", f"cannot be read: the message is a {type(data).__name__}, not an object")
    kind = data.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None or (expect is not None and cls not in expect):
        wanted = sorted(c.kind for c in (expect or _KINDS.values()))
        raise MessageError(str(kind), "kind", f"is not one of {wanted}")
    if data.get("protocol") != PROTOCOL:
        raise MessageError(kind, "protocol", f"is {data.get('protocol')!r}; this side speaks protocol {PROTOCOL}")
    return _build(cls, {k: v for k, v in data.items() if k not in ("kind", "protocol")}, kind, prefix="")


def encode(message) -> str:
    return json.dumps(to_wire(message))


def decode(raw, expect: Optional[tuple] = None):
    """The message in ``raw`` (bytes or str of JSON), checked as :func:`from_wire` does."""
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise MessageError("?", "kind", f"cannot be read: not JSON ({err})") from err
    return from_wire(data, expect)


def _plain(message) -> dict:
    return {f.name: _plain(v) if dataclasses.is_dataclass(v := getattr(message, f.name)) else v
            for f in dataclasses.fields(message)}


def _build(cls, data: dict, kind: str, prefix: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise MessageError(kind, prefix + unknown[0], "is not a field of this kind")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, field in fields.items():
        if name in data:
            values[name] = _checked(kind, prefix + name, hints[name], data[name])
        elif field.default is dataclasses.MISSING:
            raise MessageError(kind, prefix + name, "is missing")
    return cls(**values)


def _checked(kind: str, name: str, hint, value):
    optional = typing.get_origin(hint) is Union and type(None) in typing.get_args(hint)
    if optional:
        if value is None:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise MessageError(kind, name, f"has type {type(value).__name__}, expected an object")
        return _build(hint, value, kind, prefix=name + ".")
    accepted = (int, float) if hint is float else (hint,)
    if (isinstance(value, bool) and hint is not bool) or not isinstance(value, accepted):
        raise MessageError(kind, name, f"has type {type(value).__name__}, expected {hint.__name__}"
                           + (" or null" if optional else ""))
    return value
