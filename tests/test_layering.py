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


# Reads of megatron's global parallel_state outside compat/ and the group builder (was 53): code
# reads the start-up's ProcessGroupCollection instead.  Lower this as reads go; never raise it.
GLOBAL_GROUP_READS_CEILING = 0


def test_global_parallel_state_reads_stay_under_the_ceiling():
    from megatron_rl.tools import global_groups

    reads = global_groups.global_group_reads()
    assert len(reads) <= GLOBAL_GROUP_READS_CEILING, "\n".join(
        ["new reads of megatron's global parallel_state; take the groups from the ProcessGroupCollection "
         "(distributed.startup / runtime.active_groups()) instead:", *reads])


def test_the_ratchet_sees_a_global_read(tmp_path, monkeypatch):
    """Each spelling of a read counts; compat/ and the group builder do not."""
    from megatron_rl.tools import global_groups

    pkg = tmp_path / "megatron_rl"
    for sub in ("models", "compat", "distributed"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "models" / "a.py").write_text(
        "from megatron.core import parallel_state as ps\n"
        "from megatron.core.parallel_state import get_data_parallel_group\n"
        "def f():\n    from megatron.core import parallel_state\n"
        "    return ps.get_tensor_model_parallel_rank(), parallel_state.get_context_parallel_group(), "
        "get_data_parallel_group()\n")
    read = "from megatron.core import parallel_state as ps\nps.get_data_parallel_rank()\n"
    (pkg / "compat" / "b.py").write_text(read)
    (pkg / "distributed" / "runtime.py").write_text(read)
    monkeypatch.setattr(global_groups, "ROOT", str(pkg))
    monkeypatch.setattr(global_groups, "source_files", lambda: sorted(str(p) for p in pkg.rglob("*.py")))
    assert global_groups.global_group_reads() == [
        "megatron_rl/models/a.py:5 get_context_parallel_group",
        "megatron_rl/models/a.py:5 get_data_parallel_group",
        "megatron_rl/models/a.py:5 get_tensor_model_parallel_rank",
    ]
