"""The compat records and the functions that register them: the leaf every workaround module
imports (:mod:`megatron_rl.compat.registry` imports those modules to list and apply them)."""

from __future__ import annotations

import dataclasses
from typing import Callable

ANY = ""  # a version range that matches every release
# What the pinned stack (requirements-cpu.txt) tests: megatron-core 0.19.2, torch 2.13 (CPU).
MEGATRON_TESTED = ">=0.19.2,<0.20"
TORCH_TESTED = ">=2.13,<2.14"


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    megatron_versions: str
    reason: str
    apply: Callable[[], None]
    cpu_only: bool = False
    torch_versions: str = ANY


@dataclasses.dataclass(frozen=True)
class Workaround:
    """``used_in`` is ``path:symbol`` below ``megatron_rl/`` (``; `` between several places)."""

    name: str
    megatron_versions: str
    reason: str
    used_in: str
    torch_versions: str = ANY


@dataclasses.dataclass(frozen=True)
class KnownWarning:
    """``message`` and ``module`` are regular expressions as ``warnings.filterwarnings`` takes them."""

    name: str
    message: str
    category: type
    module: str
    reason: str
    megatron_versions: str = ANY
    torch_versions: str = ANY
    cpu_only: bool = False


@dataclasses.dataclass(frozen=True)
class KnownLogMessage:
    """``message`` is a regular expression matched at the start of the record's text; ``logger``
    the exact name of the logger megatron-core emits it on."""

    name: str
    message: str
    logger: str
    reason: str
    megatron_versions: str = ANY
    torch_versions: str = ANY


_PATCHES: dict[str, Patch] = {}
_WORKAROUNDS: dict[str, Workaround] = {}
_WARNINGS: dict[str, KnownWarning] = {}
_LOG_MESSAGES: dict[str, KnownLogMessage] = {}


def register_patch(patch: Patch) -> Patch:
    _PATCHES[patch.name] = patch
    return patch


def register_workaround(workaround: Workaround) -> Workaround:
    _WORKAROUNDS[workaround.name] = workaround
    return workaround


def register_warning(known: KnownWarning) -> KnownWarning:
    _WARNINGS[known.name] = known
    return known


def register_log_message(known: KnownLogMessage) -> KnownLogMessage:
    _LOG_MESSAGES[known.name] = known
    return known


def registered_warnings() -> list[KnownWarning]:
    """The known warnings registered so far (their module, warning_filters, registers them all)."""
    return list(_WARNINGS.values())


def registered_log_messages() -> list[KnownLogMessage]:
    return list(_LOG_MESSAGES.values())
