"""The rules every schema field declares for itself: numeric bounds and registry choices.

They run before the feature registry's cross-field constraints, so those may divide by a parallel
size or index a registry without guarding against values no field accepts.
"""

from __future__ import annotations

import importlib
import operator

from megatron_rl.config.loader import choice_error
from megatron_rl.config.schema import Config, iter_fields
from megatron_rl.errors import ConfigError

_BOUND_TEXT = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def _get(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def registry_choices(spec: str) -> tuple:
    """``"package.module:NAME"`` -> the names that registry accepts (a dict's keys or a sequence)."""
    module, _, name = spec.partition(":")
    registry = getattr(importlib.import_module(module), name)
    return tuple(registry)


def bounds_text(bounds: dict) -> str:
    """``{"gt": 0, "le": 1}`` -> ``"> 0 and <= 1"`` (for errors and the config reference)."""
    return " and ".join(f"{_BOUND_TEXT[op][1]} {bound}" for op, bound in bounds.items())


def check_field_rules(cfg: Config) -> None:
    """Raise a one-line :class:`ConfigError` for the first value outside its field's bounds or choices."""
    for key, field, _ in iter_fields():
        value = _get(cfg, key)
        if value is None:
            continue
        bounds = field.metadata.get("bounds", {})
        if bounds and not all(_BOUND_TEXT[op][0](value, bound) for op, bound in bounds.items()):
            raise ConfigError(key, value, f"out of range (must be {bounds_text(bounds)})",
                              f"set {key} to a value {bounds_text(bounds)}")
        spec = field.metadata.get("choices")
        if spec and value not in registry_choices(spec):
            raise choice_error(key, value, registry_choices(spec))
