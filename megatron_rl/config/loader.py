"""Load a config: schema defaults <- YAML file <- ``a.b.c=value`` overrides.

omegaconf's own errors (unknown key, wrong type) are turned into one-line :class:`ConfigError`s
that name the key and suggest the nearest valid one.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
import typing
from typing import Iterable, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf import errors as oc_errors

from megatron_rl.config import aliases
from megatron_rl.config.schema import (
    Config,
    bounds_text,
    field_bounds,
    iter_fields,
    leaf_types,
    literal_choices,
    within,
)
from megatron_rl.errors import ConfigError

_LEAF_TYPES = leaf_types()
ALL_KEYS = list(_LEAF_TYPES)
_CHOICES = {key: literal_choices(tp) for key, tp in _LEAF_TYPES.items() if literal_choices(tp)}


def _type_name(tp) -> str:
    """``int``, ``Optional[float]``, ...; a field with ``Literal`` choices reads as a string."""
    optional = typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)
    if optional:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    name = "str" if literal_choices(tp) else getattr(tp, "__name__", str(tp))
    return f"Optional[{name}]" if optional else name


_KEY_TYPES = {key: _type_name(tp) for key, tp in _LEAF_TYPES.items()}
_KNOWN = set(ALL_KEYS)
_BOUNDS = {key: field_bounds(field, _LEAF_TYPES[key]) for key, field, _ in iter_fields()}


_NOTED: set[str] = set()


def note_once(line: str) -> None:
    """One line on stderr, once, by the process the user started (not again by every rank)."""
    if line in _NOTED or os.environ.get("MEGATRON_RL_LAUNCHER") or os.environ.get("RANK", "0") != "0":
        return
    _NOTED.add(line)
    print(line, file=sys.stderr)


_TYPE_WORDS = {
    "int": "an integer", "Optional[int]": "an integer or null",
    "float": "a number", "Optional[float]": "a number or null",
    "bool": "true or false", "Optional[bool]": "true, false or null",
    "str": "a string", "Optional[str]": "a string or null", "list": "a list like [a,b]",
    "dict": "a mapping like {a: 1}",
}


def _nearest_key(key: str) -> str:
    """The fix for an unknown key: what a TRL/verl name means here, else a likely spelling."""
    match = aliases.lookup(key, _KNOWN)  # meaning before spelling: num_generations -> rollout.n
    if match and match.alias.kind == aliases.SAME and match.alias.ours in _KNOWN:
        return f"did you mean {match.alias.ours}? ({match.name} is {match.alias.origin}'s name for it)"
    if match:
        problem, fix = aliases.refusal(match, "N", _KNOWN)
        return f"{fix} ({problem})"
    if aliases.verl_section(key, _KNOWN):
        return "it is a section of verl's config: docs/coming_from_trl_verl.md maps its keys to ours"
    near = aliases.suggestion(key, ALL_KEYS)
    return f"did you mean {near}?" if near else "see docs/config.md for the valid keys"


def choice_error(key: str, value, choices) -> ConfigError:
    """The one message for a value outside a field's choices (schema ``Literal`` or a registry)."""
    names = [str(c) for c in choices]
    near = difflib.get_close_matches(str(value), names, n=1, cutoff=0.5)
    fix = (f"did you mean {near[0]}? " if near else "") + "use one of " + ", ".join(names)
    return ConfigError(key, value, "unknown choice", fix)


def _convert(err: Exception, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, (oc_errors.ConfigAttributeError, oc_errors.ConfigKeyError)):
        return ConfigError(key, None, f"unknown key (from {source})", _nearest_key(key))
    if isinstance(err, oc_errors.ValidationError):
        value = getattr(err, "value", None)
        if key in _CHOICES:
            if value is None:  # omegaconf keeps the offending value only in its message
                value = str(err).split("'")[1] if "'" in str(err) else None
            return choice_error(key, value, _CHOICES[key])
        if key not in _KEY_TYPES:
            group = next((k for k in ALL_KEYS if k.startswith(key + ".")), None) if key != "?" else None
            where = f"{key} is a group of keys" if group else "not a value key"
            return ConfigError(key, value, where, f"set its keys one by one, e.g. {group or 'parallel.tp'}=...")
        return _type_error(key, value)
    return ConfigError(key, None, str(err).splitlines()[0], "check the value against docs/config.md")


def _type_error(key: str, value) -> ConfigError:
    """A value omegaconf refused for ``key``'s type.  For an integer key the message carries its range,
    and a number outside it (``1e20``, ``inf``) reads as out of range, not as a mere type slip."""
    expected = _TYPE_WORDS.get(_KEY_TYPES[key], "a value of the documented type")
    bounds = _BOUNDS.get(key)
    if not bounds or _KEY_TYPES[key] not in ("int", "Optional[int]"):
        return ConfigError(key, value, f"wrong type, expected {expected}", f"give {expected}")
    allowed = f"an integer {bounds_text(bounds)}" + (", or null" if _KEY_TYPES[key].startswith("Optional") else "")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = None
    if number is not None and not (math.isfinite(number) and within(number, bounds)):
        return ConfigError(key, value, f"out of range (must be {allowed})", f"set {key} to {allowed}")
    return ConfigError(key, value, f"wrong type, expected {allowed}", f"give {allowed}")


def _parse_override(item: str) -> tuple[str, str]:
    if "=" not in item or item.startswith("="):
        raise ConfigError(item, None, "an override must look like key=value", "write e.g. parallel.tp=2")
    key, value = item.split("=", 1)
    return key.strip(), value


def _same_value(a: str, b: str) -> bool:
    try:
        return a.strip() == b.strip() or float(a) == float(b)
    except ValueError:
        return False


def _our_key(key: str, value: str) -> tuple[str, Optional[str]]:
    """``(key, None)`` when it is ours; a same-meaning TRL/verl name rewritten, with its note;
    else one line saying why it is refused."""
    match = aliases.lookup(key, _KNOWN)
    if match:
        alias = match.alias
        if alias.kind == aliases.SAME and match.applies and alias.ours in _KNOWN:
            return alias.ours, f"config: {alias.origin} key {key} read as our {alias.ours}={value}"
        problem, fix = aliases.refusal(match, value, _KNOWN)
        raise ConfigError(key, value, problem, fix)
    if key not in ALL_KEYS and _dict_key_of(key):
        return key, None  # an entry of a dict-valued key (reward.kwargs.scale=2): the dict takes any
    if key not in ALL_KEYS:
        group = next((k for k in ALL_KEYS if k.startswith(key + ".")), None)
        if group:
            raise ConfigError(key, value, "is a group of keys, not a value", f"set one key, e.g. {group}=...")
        raise ConfigError(key, value, "unknown key (from the command line)", _nearest_key(key))
    return key, None


def _dict_key_of(key: str) -> Optional[str]:
    """The dict-valued key ``key`` is an entry of (``reward.kwargs`` for ``reward.kwargs.scale``)."""
    parent = key.rpartition(".")[0]
    while parent:
        if _KEY_TYPES.get(parent) == "dict":
            return parent
        parent = parent.rpartition(".")[0]
    return None


def _resolve_overrides(overrides: Iterable[str]) -> list[tuple[str, str]]:
    """``(our key, value)`` per override.  Two different names for one key with different values
    are refused; the same name given twice keeps its last value, as usual.  The notes on rewritten
    names are printed once all overrides are read."""
    dotlist, given, notes = [], {}, []
    for item in overrides:
        typed, value = _parse_override(item)
        key, note = _our_key(typed, value)
        notes += [note] if note else []
        names = given.setdefault(key, {})  # every name used for this key -> its last value
        other = next(((name, v) for name, v in names.items() if name != typed and not _same_value(v, value)), None)
        if other:
            raise ConfigError(typed, value, f"conflicts with {other[0]}={other[1]}: both set {key}",
                              "give only one of them")
        names[typed] = value
        if _KEY_TYPES.get(key) in ("str", "Optional[str]") and value != "null" and not value.startswith(("'", '"')):
            # Keep strings as typed: YAML would turn e.g. run.name=on into the boolean True.  Not
            # ASCII-escaped: YAML cannot read the surrogate pairs json writes for characters
            # outside the Basic Multilingual Plane.
            value = json.dumps(value, ensure_ascii=False)
        dotlist.append((key, value))
    for note in notes:
        note_once(note)
    return dotlist


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> Config:
    """Return a validated-for-type config object (layout checks live in ``validate``)."""
    cfg: DictConfig = OmegaConf.structured(Config)
    if path:
        if not os.path.isfile(path):
            raise ConfigError("--config", path, "file not found", "give the path of a YAML file, e.g. "
                                                                  "configs/demo_cpu.yaml")
        try:
            file_cfg = OmegaConf.load(path)
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            first = str(err).splitlines()[0]
            raise ConfigError("--config", path, f"not valid YAML ({first})", "fix the YAML syntax") from None
        try:
            cfg = OmegaConf.merge(cfg, file_cfg)
        except oc_errors.OmegaConfBaseException as err:
            raise _convert(err, path) from None
        except (TypeError, ValueError, OverflowError) as err:  # e.g. a list where the schema has a mapping
            raise ConfigError("--config", path, f"a value does not fit its key ({err})",
                              "compare the file with docs/config.md") from None
    dotlist = _resolve_overrides(overrides)
    for key, value in dotlist:  # one at a time, so an error names its key
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{key}={value}"]))
        except oc_errors.OmegaConfBaseException as err:
            raise _convert(err, "the command line") from None
        except yaml.YAMLError as err:
            raise ConfigError(key, value, f"not a readable value ({str(err).splitlines()[0]})",
                              "quote the value or remove the characters YAML cannot read") from None
        except OverflowError:  # an integer too large for a float key (lr=1000...0)
            allowed = bounds_text(_BOUNDS.get(key, {})) or "that fits a float"
            raise ConfigError(key, value, f"out of range (must be {allowed})",
                              f"set {key} to a value {allowed}") from None
        except (TypeError, ValueError):  # e.g. a list for a mapping key
            expected = _TYPE_WORDS.get(_KEY_TYPES[key], "a value of the documented type")
            raise ConfigError(key, value, f"wrong type, expected {expected}",
                              f"give {expected}") from None
    return OmegaConf.to_object(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_text(cfg: Config, notes: Iterable[str] = ()) -> str:
    """``cfg`` as YAML, ``notes`` as comments at the end (what ``auto`` and derived values resolved
    to): the text stays a loadable config of what was asked.  Written by
    :func:`megatron_rl.utils.run_files.save_config`."""
    return to_yaml(cfg) + "".join(f"# {line}\n" for line in notes)
