"""The configuration is the bottom layer: nothing under ``megatron_rl/config/`` imports a package
above it (only ``config`` itself and ``errors``), and no two packages import each other in a
circle.  Read from the source, every import counted, deferred ones included."""

from __future__ import annotations

from megatron_rl.tools import import_graph


def test_config_imports_nothing_above_it():
    assert import_graph.upward_from_config() == []


def test_no_package_level_import_cycle():
    assert import_graph.cycles(import_graph.package_graph()) == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The scan finds an import inside a function of a config module (what a regression looks like)."""
    pkg = tmp_path / "megatron_rl"
    (pkg / "config").mkdir(parents=True)
    (pkg / "config" / "bad.py").write_text("def f():\n    from megatron_rl.trainer import ppo\n")
    (pkg / "trainer").mkdir()
    (pkg / "trainer" / "ppo.py").write_text("from megatron_rl.config import bad\n")
    monkeypatch.setattr(import_graph, "ROOT", str(pkg))
    assert import_graph.upward_from_config() == ["megatron_rl/config/bad.py:2 -> megatron_rl.trainer"]
    assert import_graph.cycles(import_graph.package_graph()) == [["config", "trainer"]]


def test_no_module_level_import_cycle():
    """Registries are leaves: the modules that register (rewards, compat records) import the
    decorators' module, and the registry imports them, never the other way round."""
    assert import_graph.cycles(import_graph.module_graph()) == []
