"""The rules every schema field declares for itself: numeric bounds and registry choices.

They run before the feature registry's cross-field constraints, so those may divide by a parallel
size or index a registry without guarding against values no field accepts.
"""

from __future__ import annotations

import importlib
import math
import os

from megatron_rl.config.loader import choice_error
from megatron_rl.config.schema import Config, bounds_text, field_bounds, iter_fields, leaf_types, within
from megatron_rl.errors import ConfigError

__all__ = ["bounds_text", "check_field_rules", "config_value", "registry_choices"]

_LEAF_TYPES = leaf_types()


def config_value(cfg, key: str):
    """The value of a dotted key (``model.recompute.granularity``) of a config."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def registry_choices(spec: str) -> tuple:
    """``"package.module:NAME"`` -> the names that registry accepts (a dict's keys or a sequence)."""
    module, _, name = spec.partition(":")
    registry = getattr(importlib.import_module(module), name)
    return tuple(registry)


def check_field_rules(cfg: Config) -> None:
    """Raise a one-line :class:`ConfigError` for the first value outside its field's bounds or
    choices, then for the few rules between fields that no feature owns (the model's shape, the
    run's name)."""
    for key, field, _ in iter_fields():
        value = config_value(cfg, key)
        if value is None:
            continue
        bounds = field_bounds(field, _LEAF_TYPES[key])
        if isinstance(value, float) and not math.isfinite(value):
            # No key means infinity or NaN: an infinite learning rate or temperature trains on garbage.
            allowed = bounds_text(bounds)
            raise ConfigError(key, value, "not a finite number" + (f" (must be {allowed})" if allowed else ""),
                              f"set {key} to a finite value {allowed}".strip())
        if bounds and not within(value, bounds):
            raise ConfigError(key, value, f"out of range (must be {bounds_text(bounds)})",
                              f"set {key} to a value {bounds_text(bounds)}")
        spec = field.metadata.get("choices")
        if spec and value not in registry_choices(spec):
            raise choice_error(key, value, registry_choices(spec))
    _check_shape_and_name(cfg)


def _check_shape_and_name(cfg: Config) -> None:
    model = cfg.model
    groups = model.num_query_groups or model.num_attention_heads
    if model.num_attention_heads % groups:
        raise ConfigError("model.num_query_groups", model.num_query_groups,
                          f"model.num_attention_heads={model.num_attention_heads} is not a multiple of it "
                          "(each KV head serves the same number of query heads)",
                          "use a number of KV heads that divides model.num_attention_heads")
    name = cfg.run.name
    if not name or name in (".", "..") or os.sep in name or "/" in name or (os.altsep and os.altsep in name):
        raise ConfigError("run.name", name, "is not a plain directory name (the run directory is run.dir/run.name)",
                          "use a name without path separators; put the parent directory in run.dir")
