"""Whether TransformerEngine can be used in this process."""

from __future__ import annotations

import functools
import importlib.util

from megatron_rl.compat import cuda_available


@functools.lru_cache(maxsize=1)
def te_version() -> str | None:
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        import transformer_engine  # noqa: F401
        from transformer_engine import __version__ as version  # type: ignore

        return str(version)
    except Exception:  # installed but broken (e.g. no CUDA libraries)
        return None


def te_usable() -> bool:
    return cuda_available() and te_version() is not None
