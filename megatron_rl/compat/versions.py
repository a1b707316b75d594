"""The megatron-core release a job may start with: the tested range, or an explicit opt-in.

Read from the installed package's metadata, without importing megatron-core, so the check runs in
the launcher before any rank starts.  Every workaround in :mod:`megatron_rl.compat` was derived
against the range in :data:`megatron_rl.compat.registry.MEGATRON_TESTED`; another release may
change the private code they touch (0.16 -> 0.19 changed a RoPE signature the first forward
calls), so it is refused unless ``run.allow_untested_megatron_core=true``.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

from packaging.version import Version

from megatron_rl.compat.registry import MEGATRON_TESTED, in_range
from megatron_rl.errors import ConfigError

OPT_IN_KEY = "run.allow_untested_megatron_core"
_warned = False


def installed_megatron_core() -> Version | None:
    try:
        return Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        return None


def require_tested_megatron_core(allow_untested: bool, installed: Version | None = None) -> None:
    """Stop (one line, exit 2) on a megatron-core outside :data:`MEGATRON_TESTED`, or warn once
    per job (rank 0 / the launcher) when ``allow_untested``."""
    global _warned
    version = installed or installed_megatron_core()
    if version is None:
        raise ConfigError("megatron-core", None, "not installed",
                          f"pip install 'megatron-core{MEGATRON_TESTED}' (./scripts/bootstrap.sh does)")
    if in_range(version, MEGATRON_TESTED):
        return
    if not allow_untested:
        raise ConfigError(
            "megatron-core", str(version), f"megatron_rl is tested with megatron-core{MEGATRON_TESTED} only",
            f"pip install 'megatron-core{MEGATRON_TESTED}', or set {OPT_IN_KEY}=true to run untested",
        )
    if not _warned and os.environ.get("RANK", "0") == "0":
        _warned = True
        warnings.warn(
            f"megatron-core {version} is outside the tested range {MEGATRON_TESTED} ({OPT_IN_KEY}=true): "
            "the compat workarounds were derived for the tested range; run make test on this stack",
            stacklevel=2,
        )
