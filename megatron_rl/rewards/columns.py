"""A record's dataset columns, passed to a reward function by parameter name.

TRL passes every dataset column to a reward function as a keyword list, and verl passes a record's
``extra_info``; here every convention gets the columns it asks for: a parameter named like a column
binds to it, and ``**kwargs`` takes them all.  Names the call already binds (the response, the answer,
``reward.kwargs``) are never overridden by a column.  A leaf: the grading worker imports the reward
modules, and this must stay free of torch.
"""

from __future__ import annotations

import inspect
from typing import Optional, Sequence

# Keywords the trainer's calls use for their own purposes: a column of that name is not passed.
RESERVED = ("fields", "timeout_s", "grading_workers", "completion_ids")


def parameters(fn) -> Optional[list[inspect.Parameter]]:
    """The parameters, or None when Python cannot tell (a builtin): then the function is trusted."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def takes_keyword(params: Sequence[inspect.Parameter], name: str) -> bool:
    """Whether a call may pass ``name=...``: a parameter of that name that is not positional-only, or ``**kwargs``."""
    return any(p.name == name and p.kind is not p.POSITIONAL_ONLY for p in params) or any(
        p.kind is p.VAR_KEYWORD for p in params)


def positional_names(params: Sequence[inspect.Parameter], count: int) -> tuple[str, ...]:
    """The names of the first ``count`` positional parameters (those a positional call binds)."""
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(positional[:count])


def names_of(records: Sequence[dict]) -> list[str]:
    """Every column name of ``records``, in the order they first appear."""
    seen: dict[str, None] = {}
    for record in records:
        seen.update(dict.fromkeys(k for k in record if isinstance(k, str)))
    return list(seen)


def wanted(params: Optional[Sequence[inspect.Parameter]], records: Sequence[dict], skip) -> list[str]:
    """The columns of ``records`` a function with ``params`` takes, less the names in ``skip``."""
    if params is None:
        return []
    return [name for name in names_of(records) if name not in skip and name not in RESERVED
            and takes_keyword(params, name)]


def as_lists(params, records: Sequence[dict], skip) -> dict[str, list]:
    """The columns a batch function takes, each as one list over the batch (None where a record lacks it)."""
    return {name: [record.get(name) for record in records] for name in wanted(params, records, skip)}


def per_record(params, records: Sequence[dict], skip) -> list[dict]:
    """The columns a per-sample function takes, one dict per record."""
    names = wanted(params, records, skip)
    return [{name: record[name] for name in names if name in record} for record in records]


def missing(required: Sequence[str], records: Sequence[dict]) -> Optional[tuple[int, str]]:
    """``(position, column)`` of the first record that lacks a required column, else None."""
    for i, record in enumerate(records):
        for name in required:
            if name not in record:
                return i, name
    return None
