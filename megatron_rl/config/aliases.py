"""Names TRL and verl users type, mapped to ours.

A name is looked up by its full dotted path in verl's table (``verl_keys.VERL`` and its group
patterns), else by its last two or last one dotted parts in the bare-name tables, so
``num_generations``, ``rollout.num_generations`` and ``algorithm.beta`` resolve.  A same-meaning
name is accepted and rewritten; a name read by its value (``BY_VALUE``) is accepted when its value
means what ours does; the others are refused with one line saying how ours differs.
A bare name found inside someone else's section (``critic.tensor_model_parallel_size``) is only
suggested, never applied: the section may change its meaning, as verl's rollout TP does.
``docs/coming_from_trl_verl.md`` is generated from these tables.
"""

from __future__ import annotations

import difflib
from fnmatch import fnmatchcase
from typing import NamedTuple, Optional

from megatron_rl.config import verl_keys
from megatron_rl.config.trl_keys import TRL
from megatron_rl.config.verl_keys import BY_VALUE, DIFFERENT, GENERATION, NO_EQUIVALENT, SAME, Alias

__all__ = ["Alias", "SAME", "BY_VALUE", "DIFFERENT", "GENERATION", "NO_EQUIVALENT", "TRL", "lookup", "refusal",
           "suggestion"]

NAMES = {**verl_keys.VERL_NAMES, **TRL}

# Sections whose keys are read the same wherever a bare name sits in them; any other section
# (rollout, ref, critic, reward_model, ...) may give the name another meaning.
_NEUTRAL = {"actor_rollout_ref", "actor", "megatron", "optim", "trainer", "algorithm", "data", "model"}


class Match(NamedTuple):
    alias: Alias
    name: str  # what matched: the full path, or the bare name
    applies: bool  # a SAME alias that may be rewritten without asking


def lookup(key: str, known: set[str]) -> Optional[Match]:
    """How ``key`` (not one of ours) maps to ours, or None when no table knows it."""
    if key in known:
        return None
    if key in verl_keys.VERL:
        return Match(verl_keys.VERL[key], key, True)
    group = next((alias for pattern, alias in verl_keys.VERL_GROUPS if fnmatchcase(key, pattern)), None)
    if group:
        return Match(group, key, True)
    parts = key.split(".")
    for n in (2, 1):
        if len(parts) < n:
            continue
        tail = ".".join(parts[-n:])
        if tail in NAMES:
            alias = NAMES[tail]
            section = set(parts[:-n])
            return Match(alias, tail, section <= _NEUTRAL | set((alias.ours or "").split(".")))
    return None


def refusal(match: Match, value: str, known: set[str]) -> tuple[str, str]:
    """``(problem, fix)`` for a name that is not rewritten."""
    alias, origin = match.alias, match.alias.origin
    note = alias.note.replace("{value}", str(value))
    if alias.kind == SAME and alias.ours not in known:
        return (f"{origin}'s name for {alias.ours}, which this version does not have",
                "remove it; docs/config.md lists the keys")
    if alias.kind == SAME:
        return ("unknown key (from the command line)",
                f"did you mean {alias.ours}? ({match.name} is {origin}'s name for it)")
    if alias.kind in (DIFFERENT, BY_VALUE):
        return f"{origin}'s name for a setting that differs here", f"see {alias.ours} ({note})"
    if alias.kind == GENERATION:
        return f"{origin}'s generation-side setting", note
    return f"{origin}'s setting with no equivalent here", (note + "; " if note else "") + "remove it"


def _close(word: str, candidates, cutoff: float) -> Optional[str]:
    found = difflib.get_close_matches(word, candidates, n=1, cutoff=cutoff)
    return found[0] if found else None


def verl_section(key: str, known: set[str]) -> bool:
    """``key`` is a whole section of verl's config that we do not have (``actor_rollout_ref``)."""
    ours = {k.split(".")[0] for k in known}
    return key not in ours and any(name.split(".")[0] == key for name in verl_keys.VERL)


def suggestion(key: str, keys: list[str]) -> Optional[str]:
    """A "did you mean" for a misspelt key, made only when it is likely: the whole dotted key is
    close to one of ours, or its last part is close to the last part of ours (a long name: short
    ones match too much); several keys with that last part are all named, the closest first."""
    near = _close(key, keys, 0.9)
    if near:
        return near
    last = key.split(".")[-1]
    if len(last) < 4:
        return None
    by_last: dict[str, list[str]] = {}
    for ours in keys:
        by_last.setdefault(ours.split(".")[-1], []).append(ours)
    near_last = _close(last, by_last, 0.9)
    if near_last is None:
        return None
    owners = sorted(by_last[near_last], key=lambda ours: -difflib.SequenceMatcher(None, key, ours).ratio())
    return " or ".join(owners)
