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
from dataclasses import dataclass, field
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
from megatron_rl.config.verl_keys import Context, Refused, same_setting
from megatron_rl.errors import ConfigError, ConfigErrors

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


def _as_text(value) -> str:
    """A value read from a YAML file, as it would be typed on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _parsed(text: str):
    """A typed value as YAML reads it: ``True`` a boolean, ``['a','b']`` a list, ``'error'`` a string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _our_key(key: str, value: str, source: str = "the command line") -> tuple[Optional[str], Optional[str],
                                                                               Optional[aliases.Alias]]:
    """``(key, None, None)`` when it is ours; a same-meaning TRL/verl name rewritten, with its note;
    ``(None, None, alias)`` for a name read by its value once every key is merged; else one line
    saying why it is refused."""
    match = aliases.lookup(key, _KNOWN)
    if match:
        alias = match.alias
        if alias.kind == aliases.SAME and match.applies and alias.ours in _KNOWN:
            _refuse_a_list_for_one_value(key, value, alias.ours)
            return alias.ours, f"config: {alias.origin} key {key} read as our {alias.ours}={value}", None
        if alias.kind == aliases.BY_VALUE and match.applies:
            return None, None, alias
        problem, fix = aliases.refusal(match, value, _KNOWN)
        raise ConfigError(key, value, problem, fix)
    if key not in ALL_KEYS and _dict_key_of(key):
        return key, None, None  # an entry of a dict-valued key (reward.kwargs.scale=2): the dict takes any
    if key not in ALL_KEYS:
        group = next((k for k in ALL_KEYS if k.startswith(key + ".")), None)
        if group:
            raise ConfigError(key, value, "is a group of keys, not a value", f"set one key, e.g. {group}=...")
        raise ConfigError(key, value, f"unknown key (from {source})", _nearest_key(key))
    return key, None, None


def _refuse_a_list_for_one_value(key: str, value: str, ours: str) -> None:
    """verl takes lists where ours takes one value (``data.train_files=[a,b]``): not read as one string."""
    if _KEY_TYPES[ours] in ("str", "Optional[str]") and isinstance(_parsed(value), list):
        raise ConfigError(key, value, f"a list, and {ours} takes one value", f"give one value (for {ours}: one "
                                                                              "file, the files joined into one)")


def _dict_key_of(key: str) -> Optional[str]:
    """The dict-valued key ``key`` is an entry of (``reward.kwargs`` for ``reward.kwargs.scale``)."""
    parent = key.rpartition(".")[0]
    while parent:
        if _KEY_TYPES.get(parent) == "dict":
            return parent
        parent = parent.rpartition(".")[0]
    return None


@dataclass
class _Reading:
    """What the file and the command line say, gathered before anything is refused: every refusal of
    a run is reported at once, and the notes only when nothing is refused."""

    errors: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    typed: dict = field(default_factory=dict)  # every name typed -> its value as text, the file's first
    given: set = field(default_factory=set)  # our keys set by any name
    by_value: dict = field(default_factory=dict)  # a name read by its value -> (its text, its alias)


def _resolve_names(items: Iterable[tuple[str, str]], source: str, reading: _Reading,
                   names_of: Optional[dict] = None) -> list[tuple[str, str]]:
    """``(our key, value)`` per name.  Two different names for one key with different values are
    refused; the same name given twice keeps its last value, as usual.  ``names_of`` holds the
    names already given for each key by the same source."""
    dotlist, names_of = [], names_of if names_of is not None else {}
    for typed, value in items:
        reading.typed[typed] = value
        try:
            key, note, alias = _our_key(typed, value, source)
        except ConfigError as err:
            reading.errors.append(err)
            continue
        if alias is not None:
            reading.by_value[typed] = (value, alias)
            continue
        names = names_of.setdefault(key, {})  # every name used for this key -> its last value
        other = next(((name, v) for name, v in names.items() if name != typed and not _same_value(v, value)), None)
        if other:
            reading.errors.append(ConfigError(typed, value, f"conflicts with {other[0]}={other[1]}: both set {key}",
                                              "give only one of them"))
            continue
        names[typed] = value
        reading.notes += [note] if note else []
        reading.given.add(key)
        dotlist.append((key, value))
    return dotlist


def _typed_value(key: str, value: str) -> str:
    """Keep strings as typed: YAML would turn e.g. run.name=on into the boolean True.  Not
    ASCII-escaped: YAML cannot read the surrogate pairs json writes for characters outside the
    Basic Multilingual Plane."""
    if _KEY_TYPES.get(key) in ("str", "Optional[str]") and value != "null" and not value.startswith(("'", '"')):
        return json.dumps(value, ensure_ascii=False)
    return value


def _merge_dotlist(cfg: DictConfig, dotlist: list[tuple[str, str]], source: str, errors: list) -> DictConfig:
    """Merge ``key=value`` pairs one at a time, so each error names its key; errors are collected.
    A mapping-valued key (``reward.kwargs``, ``algorithm.distill.teachers``, ...) takes the value
    given, whole: merged, ``teachers={}`` would leave a file's teachers in place and ``{math: P}`` add
    one beside them."""
    for key, value in dotlist:
        try:
            update = OmegaConf.from_dotlist([f"{key}={_typed_value(key, value)}"])
            if _KEY_TYPES.get(key) == "dict":
                replaced = OmegaConf.select(update, key)
                if not isinstance(replaced, DictConfig):
                    raise TypeError(key)  # one line naming the value as given, below
                OmegaConf.update(cfg, key, replaced, merge=False)
                continue
            cfg = OmegaConf.merge(cfg, update)
        except oc_errors.OmegaConfBaseException as err:
            errors.append(_convert(err, source))
        except yaml.YAMLError as err:
            errors.append(ConfigError(key, value, f"not a readable value ({str(err).splitlines()[0]})",
                                      "quote the value or remove the characters YAML cannot read"))
        except OverflowError:  # an integer too large for a float key (lr=1000...0)
            allowed = bounds_text(_BOUNDS.get(key, {})) or "that fits a float"
            errors.append(ConfigError(key, value, f"out of range (must be {allowed})",
                                      f"set {key} to a value {allowed}"))
        except (TypeError, ValueError):  # e.g. a list for a mapping key
            expected = _TYPE_WORDS.get(_KEY_TYPES[key], "a value of the documented type")
            errors.append(ConfigError(key, value, f"wrong type, expected {expected}", f"give {expected}"))
    return cfg


def _read_file(path: str) -> list[tuple[str, object]]:
    """The file's settings as ``(dotted key, value)`` pairs: a key of ours (a dict-valued one whole),
    or a leaf under names we do not have, to be read as the same name on the command line is."""
    if not os.path.isfile(path):
        raise ConfigError("--config", path, "file not found", "give the path of a YAML file, e.g. "
                                                              "configs/demo_cpu.yaml")
    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        first = str(err).splitlines()[0]
        raise ConfigError("--config", path, f"not valid YAML ({first})", "fix the YAML syntax") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError("--config", path, "is not a mapping of keys", "write key: value lines, e.g. parallel: "
                                                                         "{tp: 2}")
    pairs: list[tuple[str, object]] = []
    _flatten(OmegaConf.to_container(loaded, resolve=False), "", pairs)
    return pairs


def _flatten(node: dict, prefix: str, pairs: list) -> None:
    for name, value in node.items():
        key = f"{prefix}{name}"
        if key in _KNOWN or _dict_key_of(key):
            pairs.append((key, value))
        elif isinstance(value, dict) and value:
            _flatten(value, key + ".", pairs)
        elif not (isinstance(value, dict) and any(k.startswith(key + ".") for k in ALL_KEYS)):
            pairs.append((key, value))  # a foreign leaf, or a value where we have a group (refused later)


def _merge_file(cfg: DictConfig, path: str, reading: _Reading) -> DictConfig:
    """The file's keys of ours merged at once (one at a time when that fails, to name every bad one);
    the other names read as on the command line."""
    ours, foreign = [], []
    for key, value in _read_file(path):
        (ours if key in _KNOWN or _dict_key_of(key) else foreign).append((key, value))
    nested: dict = {}
    for key, value in ours:
        _nest(nested, key, value)
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(nested))
    except (oc_errors.OmegaConfBaseException, TypeError, ValueError, OverflowError):
        for key, value in ours:
            cfg = _merge_one_file_key(cfg, key, value, path, reading.errors)
    names_of = {}
    for key, value in ours:
        reading.typed[key] = _as_text(value)
        reading.given.add(key)
        names_of[key] = {key: _as_text(value)}
    return _merge_dotlist(cfg, _resolve_names([(k, _as_text(v)) for k, v in foreign], path, reading, names_of),
                          path, reading.errors)


def _nest(nested: dict, key: str, value) -> dict:
    """``a.b.c: value`` put into ``nested`` as ``{a: {b: {c: value}}}``."""
    node = nested
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return nested


def _merge_one_file_key(cfg: DictConfig, key: str, value, path: str, errors: list) -> DictConfig:
    try:
        return OmegaConf.merge(cfg, OmegaConf.create(_nest({}, key, value)))
    except oc_errors.OmegaConfBaseException as err:
        errors.append(_convert(err, path))
    except (TypeError, ValueError, OverflowError) as err:  # e.g. a list where the schema has a mapping
        errors.append(ConfigError(key, _as_text(value), f"a value does not fit its key ({err})",
                                  "compare the file with docs/config.md"))
    return cfg


def _world_size(world_size: Optional[int]) -> Optional[int]:
    """The job's process count where it is known before launch: given, or set by torchrun / srun."""
    if world_size is not None:
        return world_size
    return int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None


def _apply_by_value(cfg: DictConfig, reading: _Reading, world_size: Optional[int]) -> DictConfig:
    """The names read by their value, once every key is merged: what they set, or why they are refused."""
    context = Context(lambda key: OmegaConf.select(cfg, key),
                      {name: _parsed(text) for name, text in reading.typed.items()},
                      frozenset(reading.given), _world_size(world_size))
    sets: dict = {}  # our key -> (the name that set it, its value)
    for typed, (text, alias) in reading.by_value.items():
        try:
            result = alias.rule(_parsed(text), context)
        except Refused as refused:
            reading.errors.append(ConfigError(typed, text, f"{refused.problem} ({alias.origin}'s name)", refused.fix))
            continue
        clash = _clash(typed, text, result, sets, context)
        if clash:
            reading.errors.append(clash)
            continue
        sets.update({key: (typed, value) for key, value in result.sets.items()})
        reading.notes.append(_by_value_note(alias, typed, text, result))
    return _merge_dotlist(cfg, [(key, _as_text(value)) for key, (_, value) in sets.items()], "the command line",
                          reading.errors)


def _clash(typed: str, text: str, result, sets: dict, context: Context) -> Optional[ConfigError]:
    """A key set two ways: by two names read by value, or by one of them and the key itself."""
    for key, value in result.sets.items():
        if key in sets and not same_setting(sets[key][1], value):
            return ConfigError(typed, text, f"conflicts with {sets[key][0]}: both set {key}", "give only one of them")
        if key in context.given and not result.replaces and not same_setting(context.value(key), value):
            return ConfigError(typed, text, f"conflicts with {key}={context.value(key)}: it sets {key}={value}",
                               "give only one of them")
    return None


def _by_value_note(alias, typed: str, text: str, result) -> str:
    if result.sets:
        read = ", ".join(f"{key}={_as_text(value)}" for key, value in result.sets.items())
        return f"config: {alias.origin} key {typed}={text} read as our {read} ({result.why})"
    return f"config: {alias.origin} key {typed}={text} accepted: {result.why}"


def _raise_all(errors: list) -> None:
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors.of(errors)


def load_config(path: Optional[str] = None, overrides: Iterable[str] = (), world_size: Optional[int] = None) -> Config:
    """Return a validated-for-type config object (layout checks live in ``validate``).  Every refused
    key of the file and the command line is reported in one error.  ``world_size``, when the caller
    knows it, is what verl's trainer.n_gpus_per_node x trainer.nnodes must equal."""
    cfg: DictConfig = OmegaConf.structured(Config)
    reading = _Reading()
    if path:
        cfg = _merge_file(cfg, path, reading)
    items = []
    for item in overrides:
        try:
            items.append(_parse_override(item))
        except ConfigError as err:
            reading.errors.append(err)
    cfg = _merge_dotlist(cfg, _resolve_names(items, "the command line", reading), "the command line",
                         reading.errors)
    cfg = _apply_by_value(cfg, reading, world_size)
    _raise_all(reading.errors)
    for note in reading.notes:
        note_once(note)
    return OmegaConf.to_object(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_text(cfg: Config, notes: Iterable[str] = ()) -> str:
    """``cfg`` as YAML, ``notes`` as comments at the end (what ``auto`` and derived values resolved
    to): the text stays a loadable config of what was asked.  Written by
    :func:`megatron_rl.utils.run_files.save_config`."""
    return to_yaml(cfg) + "".join(f"# {line}\n" for line in notes)
