"""One list of every workaround for megatron-core, torch or TransformerEngine.

Three kinds of record, each naming the versions it was written for and why it exists, so an
upgrade shows at a glance what to re-check (``megatron-rl features`` prints all of them):

* :class:`Patch` -- changes megatron-core or torch when :func:`apply_patches` runs;
* :class:`Workaround` -- code that avoids a megatron-core behaviour where it is needed (a config
  value, a call, an override); nothing is applied, ``used_in`` says where it acts;
* :class:`KnownWarning` -- a warning megatron-core or torch emits on the tested stack that the
  user cannot act on, silenced by message (:mod:`megatron_rl.compat.warning_filters`);
* :class:`KnownLogMessage` -- the same for a message megatron-core sends through ``logging``
  rather than ``warnings`` (a filter on that one logger, by message).

Ranges name what was tested -- only the pinned stack of requirements-cpu.txt -- so a newer release
falls outside them and :func:`warn_untested` names the records to re-check, once per process.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Optional

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_rl.compat.records import (  # noqa: F401 - the records, listed and applied here
    _LOG_MESSAGES,
    _PATCHES,
    _WARNINGS,
    _WORKAROUNDS,
    ANY,
    MEGATRON_TESTED,
    TORCH_TESTED,
    KnownLogMessage,
    KnownWarning,
    Patch,
    Workaround,
    register_log_message,
    register_patch,
    register_warning,
    register_workaround,
)

_APPLIED: set[str] = set()
_WARNED_UNTESTED = False


def _load_records() -> None:
    from megatron_rl.compat import (  # noqa: F401
        cpu,
        inference_cpu,
        inference_graphs,
        inference_hooks,
        megatron_fixes,
        paged_attention,
        parallel_state,
        resharding,
        rope_host_seqlens,
        safe_unpickling,
        torch_varlen,
        warning_filters,
        weights_only_common,
        yarn,
    )


def all_patches() -> list[Patch]:
    _load_records()
    return list(_PATCHES.values())


def all_workarounds() -> list[Workaround]:
    _load_records()
    return list(_WORKAROUNDS.values())


def all_known_warnings() -> list[KnownWarning]:
    _load_records()
    return list(_WARNINGS.values())


def all_known_log_messages() -> list[KnownLogMessage]:
    _load_records()
    return list(_LOG_MESSAGES.values())


def applied_patches() -> list[str]:
    return sorted(_APPLIED)


def megatron_core_version() -> Version:
    from megatron.core import package_info

    return Version(package_info.__version__)


def torch_version() -> Version:
    return Version(importlib.metadata.version("torch"))


def in_range(version: Version, spec: str) -> bool:
    """Whether ``version`` (local tags like ``+cpu`` ignored) is inside ``spec``."""
    return Version(version.public) in SpecifierSet(spec) if spec else True


def untested_records(cpu: bool, megatron: Optional[Version] = None, torch: Optional[Version] = None) -> list[str]:
    """Names of the patches (those this process applies) and workarounds whose version ranges
    exclude the installed megatron-core or torch.  Warning filters are left out: a stale one
    matches nothing."""
    _load_records()
    megatron = megatron or megatron_core_version()
    torch = torch or torch_version()
    records = [p for p in _PATCHES.values() if cpu or not p.cpu_only] + list(_WORKAROUNDS.values())
    return [r.name for r in records if not is_tested(r, megatron, torch)]


def is_tested(record, megatron: Optional[Version] = None, torch: Optional[Version] = None) -> bool:
    """Whether the installed (or given) versions are inside ``record``'s ranges."""
    megatron = megatron or megatron_core_version()
    torch = torch or torch_version()
    return in_range(megatron, record.megatron_versions) and in_range(torch, record.torch_versions)


def warn_untested(cpu: bool) -> None:
    """One warning per process naming every record written for other versions than these."""
    global _WARNED_UNTESTED
    if _WARNED_UNTESTED:
        return
    _WARNED_UNTESTED = True
    names = untested_records(cpu)
    if names:
        warnings.warn(
            f"megatron_rl compat workarounds written for other versions than megatron-core "
            f"{megatron_core_version()} / torch {torch_version()}: {', '.join(names)}; they are used "
            f"anyway -- run the parity tests (make test) before trusting this combination",
            stacklevel=3,
        )


def apply_patches(cpu: bool) -> list[str]:
    """Apply every registered patch that fits this process; return the names applied now."""
    _load_records()
    warn_untested(cpu)
    done = []
    for patch in _PATCHES.values():
        if patch.name in _APPLIED or (patch.cpu_only and not cpu):
            continue
        patch.apply()
        _APPLIED.add(patch.name)
        done.append(patch.name)
    return done
