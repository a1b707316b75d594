"""Where a reward function (or tool) lives: ``package.module:qualname`` or ``/path/file.py:qualname``.

Its own module so that the grading worker (``python -m megatron_rl.rewards.worker``) and the
modules that name its functions share these helpers without importing the worker module first
(which ``-m`` would then run a second time).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

FILE_MODULE_PREFIX = "megatron_rl_reward_file_"  # the module name of a reward file imported by its path


def is_file_location(location: str) -> bool:
    """Whether the part of ``reward.fn`` before ``:`` is a Python file, not a module name."""
    return location.endswith(".py")


def file_module_name(path: str) -> str:
    """One module name per file: the same in every process, distinct for files of the same name."""
    stem = "".join(ch if ch.isalnum() else "_" for ch in os.path.basename(path)[:-3])
    return f"{FILE_MODULE_PREFIX}{stem}_{hashlib.sha1(path.encode()).hexdigest()[:10]}"


def import_file(path: str):
    """The module of the Python file at ``path``, imported by path (as verl imports its
    ``custom_reward_function.path``) once per process and kept in ``sys.modules`` so that its functions
    pickle and name their module.  ``FileNotFoundError`` when there is no such file."""
    path = os.path.abspath(path)
    name = file_module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def file_of_module(module_name: str):
    """The path of a reward file imported by :func:`import_file`, else None (an ordinary module)."""
    module = sys.modules.get(module_name) if module_name.startswith(FILE_MODULE_PREFIX) else None
    return getattr(module, "__file__", None)


def import_spec(spec: str):
    """The object ``"package.module:qualname"`` or ``"/path/file.py:qualname"`` names."""
    location, _, qualname = spec.rpartition(":")
    obj = import_file(location) if is_file_location(location) else importlib.import_module(location)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    return obj
