"""Import a script of ``benchmarks/`` in a test, under its own module name."""

from __future__ import annotations

import importlib.util
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as module ``name``, with ``benchmarks/`` on ``sys.path``: its own
    imports of neighbouring scripts resolve, and pool workers unpickle its functions by that name."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
