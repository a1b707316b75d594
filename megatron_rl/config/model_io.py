"""A model config to and from the plain dict stored in a checkpoint's ``meta.json``.

The trainer writes it on save; ``convert`` and resume read it back, so a checkpoint names the
architecture it holds without the run's YAML.
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from typing import Any, Literal, Optional

from megatron_rl.config.schema import ModelConfig, MoEConfig, RecomputeConfig, RopeScalingConfig

# Keys older checkpoints wrote that :func:`model_config_from_dict` still reads.
_LEGACY_KEYS = {"rope_scaling_factor": Optional[float]}
_INT64_MAX = 2**63 - 1


def model_config_to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def _fits(value: Any, tp: Any) -> bool:
    """Whether ``value`` (from JSON) is a value of the schema type ``tp``."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return any(_fits(value, arg) for arg in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp) and type(value) is str
    if tp is type(None):
        return value is None
    if tp is bool:
        return type(value) is bool
    if tp is int:
        return type(value) is int
    if tp is float:
        return type(value) in (int, float)
    if tp is str:
        return isinstance(value, str)
    if tp is list:
        return isinstance(value, list) and all(isinstance(v, (str, int)) and type(v) is not bool for v in value)
    return False


def _in_bounds(value: Any, bounds: dict) -> bool:
    """Whether a number is inside the schema field's bounds (``ge``, ``gt``, ``le``, ``lt``)."""
    if type(value) not in (int, float):
        return True
    if type(value) is int and abs(value) > _INT64_MAX:  # what torch takes
        return False
    compare = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}
    return all(compare[kind](value, limit) for kind, limit in bounds.items())


def model_dict_problem(data: Any, cls: type = ModelConfig, prefix: str = "") -> Optional[str]:
    """What keeps ``data`` (a model config read back from a checkpoint) from being a
    :class:`ModelConfig`, naming the key; None when nothing does.  A checkpoint from elsewhere is
    checked here, so a wrong key or type stops as one line instead of inside the model builder."""
    if not isinstance(data, dict):
        return f"model setting {prefix[:-1]} is not an object" if prefix else "the model settings are not an object"
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            if cls is ModelConfig and key in _LEGACY_KEYS and _fits(value, _LEGACY_KEYS[key]):
                continue
            return f"unknown model setting {name}"
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            problem = model_dict_problem(value, tp, name + ".")
            if problem:
                return problem
        elif not _fits(value, tp) or not _in_bounds(value, fields[key].metadata.get("bounds", {})):
            text = repr(value)
            return f"model setting {name} is {text if len(text) <= 40 else text[:37] + '...'}, not a valid value"
    return None


def model_config_from_dict(data: dict) -> ModelConfig:
    """The :class:`ModelConfig` of ``data``; ValueError naming the key when it is not one."""
    problem = model_dict_problem(data)
    if problem:
        raise ValueError(problem)
    data = dict(data)
    data["recompute"] = RecomputeConfig(**data.get("recompute", {}))
    data["moe"] = MoEConfig(**data.get("moe", {}))  # checkpoints of dense models written before MoE have none
    data["rope_scaling"] = RopeScalingConfig(**data.get("rope_scaling", {}))
    legacy_factor = data.pop("rope_scaling_factor", None)  # written before YaRN: Llama-3 scaling only
    if legacy_factor is not None:
        data["rope_scaling"] = RopeScalingConfig(type="llama3", factor=legacy_factor)
    return ModelConfig(**data)
