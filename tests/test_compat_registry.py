"""The compat registry: every workaround names its versions, reason and place, and only patches apply."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_rl.compat.registry import (
    MEGATRON_TESTED,
    TORCH_TESTED,
    all_known_warnings,
    all_patches,
    all_workarounds,
    untested_records,
)
from megatron_rl.compat.warning_filters import pytest_filter_lines
from megatron_rl.testing.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_rl")


def _pinned(name: str) -> Version:
    with open(os.path.join(ROOT, "requirements-cpu.txt")) as fh:
        for line in fh:
            m = re.match(rf"^{re.escape(name)}==(\S+)", line.strip())
            if m:
                return Version(m.group(1))
    raise AssertionError(f"{name} is not pinned in requirements-cpu.txt")


def test_every_record_names_versions_and_a_reason():
    records = [*all_patches(), *all_workarounds(), *all_known_warnings()]
    assert len({r.name for r in records}) == len(records), "record names must be unique"
    for record in records:
        assert len(record.reason) > 30, record.name
        SpecifierSet(record.megatron_versions)
        SpecifierSet(record.torch_versions)
    for record in [*all_patches(), *all_workarounds()]:
        assert record.megatron_versions, f"{record.name}: no megatron-core range"
    for patch in all_patches():
        if patch.cpu_only:
            assert patch.torch_versions == TORCH_TESTED, f"{patch.name}: the CPU layer depends on the torch build"


def test_ranges_are_what_is_tested():
    """The pinned stack is inside every range; the next megatron-core release is outside all of
    them, so it warns as untested instead of claiming a check that never ran."""
    megatron, torch = _pinned("megatron-core"), _pinned("torch")
    assert megatron in SpecifierSet(MEGATRON_TESTED) and torch in SpecifierSet(TORCH_TESTED)
    assert untested_records(cpu=True, megatron=megatron, torch=torch) == []
    names = {r.name for r in [*all_patches(), *all_workarounds()]}
    nxt = Version(f"{megatron.major}.{megatron.minor + 1}.0")
    assert set(untested_records(cpu=True, megatron=nxt, torch=torch)) == names
    # The CPU layer depends on the torch build; so do the few patches of torch itself, everywhere.
    cpu_patches = {p.name for p in all_patches() if p.cpu_only}
    torch_patches = {p.name for p in all_patches() if not p.cpu_only and p.torch_versions == TORCH_TESTED}
    assert set(untested_records(cpu=True, megatron=megatron, torch=Version("2.14.0"))) == cpu_patches | torch_patches
    assert set(untested_records(cpu=False, megatron=megatron, torch=Version("2.14.0"))) == torch_patches


@pytest.mark.parametrize("workaround", all_workarounds(), ids=lambda w: w.name)
def test_workaround_points_at_code_that_exists(workaround):
    for place in workaround.used_in.split(";"):
        path, _, symbol = place.strip().partition(":")
        full = os.path.join(PACKAGE, path)
        assert os.path.isfile(full), f"{workaround.name}: {path} does not exist"
        with open(full) as fh:
            text = fh.read()
        assert symbol.split(".")[-1] in text, f"{workaround.name}: {symbol!r} not in {path}"


_PROBE = """
import json
from megatron_rl.compat import enable_compat
from megatron_rl.compat.registry import all_patches, all_workarounds, applied_patches
enable_compat()
print(json.dumps({"applied": applied_patches(), "patches": [p.name for p in all_patches() if not p.cpu_only],
                  "workarounds": [w.name for w in all_workarounds()]}))
"""


def test_workarounds_are_listed_but_never_applied():
    """In a fresh interpreter (patches cannot be undone): enable_compat applies patches only."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["workarounds"] and set(out["patches"]) <= set(out["applied"]), out
    assert not set(out["workarounds"]) & set(out["applied"]), out


def test_pytest_ini_filters_are_the_known_warnings():
    parser = configparser.RawConfigParser()
    parser.read(os.path.join(ROOT, "pytest.ini"))
    lines = [line.strip() for line in parser.get("pytest", "filterwarnings").splitlines() if line.strip()]
    assert lines == pytest_filter_lines()


@pytest.mark.parametrize("known", all_known_warnings(), ids=lambda k: k.name)
def test_known_warning_is_a_narrow_filter(known):
    """A message (never a bare category), compilable, and free of ':' (pytest.ini's separator)."""
    assert len(known.message) > 20 and ":" not in known.message + known.module, known.name
    re.compile(known.message)
    re.compile(known.module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from megatron_rl.compat.warning_filters import quiet_known_warnings

        quiet_known_warnings(cpu=True)
        with pytest.raises(known.category):  # the same category with another message still shows
            warnings.warn_explicit("an unrelated warning", known.category, "x.py", 1, module="megatron.core.x")


def reduce_transposed_view():
    """megatron's ``_reduce`` on a non-contiguous tensor returns the reduced values (0.16 returned the
    unreduced input and needed a patch; 0.19.2 reduces a contiguous copy and returns it)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    from megatron_rl.testing.layouts import use_layout

    use_layout(tp=2)
    rank = ps.get_tensor_model_parallel_rank()
    x = (torch.arange(6.0).reshape(2, 3) + 10 * rank).t()
    assert not x.is_contiguous()
    return mappings._reduce(x, ps.get_tensor_model_parallel_group()).tolist()


def test_tp_reduce_of_a_noncontiguous_tensor():
    import torch

    expected = (2 * torch.arange(6.0).reshape(2, 3) + 10).t().tolist()
    assert run_distributed(2, reduce_transposed_view) == [expected, expected]


def test_known_log_messages_are_dropped_and_others_kept():
    """megatron-core logs some notices through ``logging`` (GPTModel's deprecation, the async-save
    one): the filter drops exactly those messages on exactly those loggers."""
    import logging

    from megatron_rl.compat.registry import all_known_log_messages
    from megatron_rl.compat.warning_filters import quiet_known_log_messages

    quiet_known_log_messages()
    quiet_known_log_messages()  # a second call replaces the filter, it does not stack one more
    for known in all_known_log_messages():
        logger = logging.getLogger(known.logger)
        assert len(logger.filters) == 1, known.name
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger.addHandler(handler)
        try:
            logger.warning(known.message.replace("\\", "") + " and the rest of it")
            logger.warning("an unrelated notice from the same module")
        finally:
            logger.removeHandler(handler)
        assert [r.getMessage() for r in records] == ["an unrelated notice from the same module"], known.name


def test_gptmodel_deprecation_is_the_message_megatron_logs():
    """The filter's text is megatron-core's: its source still logs it (a changed wording would
    otherwise slip through unnoticed as a filter that matches nothing)."""
    import importlib.util
    import re

    from megatron_rl.compat.registry import all_known_log_messages

    for known in all_known_log_messages():
        spec = importlib.util.find_spec(known.logger)
        with open(spec.origin) as fh:
            source = fh.read()
        assert re.search(known.message, source.replace('"\n', "").replace('    "', "")), known.name


def test_megatron_core_outside_the_tested_range_stops_before_launch():
    from megatron_rl.compat.versions import OPT_IN_KEY, require_tested_megatron_core
    from megatron_rl.errors import ConfigError

    require_tested_megatron_core(False, installed=_pinned("megatron-core"))  # the pin passes silently
    for untested in ("0.16.1", "0.18.2", "0.20.0"):
        with pytest.raises(ConfigError) as err:
            require_tested_megatron_core(False, installed=Version(untested))
        line = str(err.value)
        assert "\n" not in line and untested in line and MEGATRON_TESTED in line and OPT_IN_KEY in line, line
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        require_tested_megatron_core(True, installed=Version("0.20.0"))
        require_tested_megatron_core(True, installed=Version("0.20.0"))
    assert len(seen) == 1 and "0.20.0" in str(seen[0].message), [str(w.message) for w in seen]


def test_bootstrap_without_python_312_says_what_to_install(tmp_path):
    """scripts/bootstrap.sh looks on PATH, then among pyenv's interpreters; with neither it stops
    with one line and exit 2 instead of building a venv megatron-core 0.19 cannot install into."""
    os.makedirs(tmp_path / "scripts")
    with open(os.path.join(ROOT, "scripts", "bootstrap.sh")) as src:
        (tmp_path / "scripts" / "bootstrap.sh").write_text(src.read())
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "no-pyenv")}
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "bootstrap.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    if proc.returncode == 0 or "creating .venv" in proc.stderr:
        pytest.skip("this machine has a Python 3.12 on /usr/bin")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Python 3.12" in lines[0] and "fix:" in lines[0], proc.stderr
    assert not (tmp_path / ".venv").exists()


def test_megatron_core_reports_its_own_version_not_the_checkouts_commit():
    """megatron-core appends the git hash of the repository its install directory sits in; in this
    checkout's .venv that would be our commit.  Both ways a process starts -- through megatron_rl,
    and a bare interpreter of the venv bootstrap.sh made -- see the plain release."""
    code = "import megatron_rl.compat, megatron.core as m; print(m.__version__)"
    env = {k: v for k, v in os.environ.items() if k != "NO_VCS_VERSION"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == str(_pinned("megatron-core")), proc.stdout + proc.stderr[-2000:]
    venv_python = os.path.join(ROOT, ".venv", "bin", "python")
    if os.path.realpath(sys.executable).startswith(os.path.realpath(os.path.join(ROOT, ".venv"))):
        proc = subprocess.run([venv_python, "-c", "import megatron.core as m; print(m.__version__)"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.stdout.strip() == str(_pinned("megatron-core")), proc.stdout + proc.stderr[-2000:]
