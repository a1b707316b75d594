"""One list of every workaround we apply to megatron-core, torch or TransformerEngine.

Each :class:`Patch` names the megatron-core versions it was written for and why it exists, so an
upgrade shows at a glance what to re-check.  ``megatron-rl features`` prints this list.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    megatron_versions: str
    reason: str
    apply: Callable[[], None]
    cpu_only: bool = False


_PATCHES: dict[str, Patch] = {}
_APPLIED: set[str] = set()


def register_patch(patch: Patch) -> Patch:
    _PATCHES[patch.name] = patch
    return patch


def all_patches() -> list[Patch]:
    return list(_PATCHES.values())


def applied_patches() -> list[str]:
    return sorted(_APPLIED)


def megatron_core_version() -> Version:
    from megatron.core import package_info

    return Version(package_info.__version__)


def apply_patches(cpu: bool) -> list[str]:
    """Apply every registered patch that fits this process; return the names applied now."""
    version = megatron_core_version()
    done = []
    for patch in _PATCHES.values():
        if patch.name in _APPLIED or (patch.cpu_only and not cpu):
            continue
        if version not in SpecifierSet(patch.megatron_versions):
            warnings.warn(
                f"megatron_rl compat patch {patch.name!r} was written for megatron-core "
                f"{patch.megatron_versions}, found {version}; applying it anyway -- run the "
                f"parity tests (make test) before trusting this combination",
                stacklevel=2,
            )
        patch.apply()
        _APPLIED.add(patch.name)
        done.append(patch.name)
    return done
