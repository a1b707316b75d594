"""Config loading and validation: bad input fails early, in one line that names the key."""

from __future__ import annotations

import pytest

from megatron_rl.config.loader import load_config
from megatron_rl.errors import ConfigError
from megatron_rl.utils.run_files import save_config
from megatron_rl.validation import validate


def _error(overrides, world=None, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(path, overrides), world)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_overrides_are_typed_and_applied():
    cfg = load_config(None, ["parallel.tp=2", "actor.optim.lr=3e-4", "parallel.sequence_parallel=true",
                             "model.recompute.modules=[core_attn]"])
    assert cfg.parallel.tp == 2 and cfg.actor.optim.lr == pytest.approx(3e-4)
    assert cfg.parallel.sequence_parallel is True
    assert cfg.model.recompute.modules == ["core_attn"]


@pytest.mark.parametrize("overrides,world,key,words", [
    (["parallel.tp=3"], 4, "parallel.tp=3", "not divisible by tp*pp*cp"),
    (["parallel.tp=2", "model.num_attention_heads=3"], 2, "parallel.tp=2", "num_attention_heads=3"),
    (["parallel.tp=4", "model.num_query_groups=2"], 4, "parallel.tp=4", "KV heads"),
    (["parallel.pp=3"], 3, "parallel.pp=3", "num_layers=2 is not divisible by pp"),
    (["parallel.vpp=2"], 1, "parallel.vpp=2", "need pipeline parallelism"),
    (["parallel.pp=2", "parallel.vpp=2", "model.num_layers=6"], 2, "parallel.vpp=2", "pp*vpp"),
    (["model.recompute.granularity=selective", "model.recompute.modules=[mlp]"], 1,
     "model.recompute.modules", "needs TransformerEngine"),
    (["model.transformer_impl=transformer_engine"], 1, "model.transformer_impl=transformer_engine",
     "TransformerEngine"),
])
def test_bad_layouts_are_rejected_with_the_key(overrides, world, key, words):
    text = _error(overrides, world)
    assert text.startswith("config error: " + key), text
    assert words in text and "fix:" in text and "[feature matrix:" in text


def test_pp2_vpp_with_batched_p2p_is_rejected():
    text = _error(["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4", "parallel.batch_p2p_comm=true"], 2)
    assert "silently wrong" in text and "batch_p2p_comm=false" in text
    # Left on auto, the same layout is accepted and batched p2p is switched off for it.
    from megatron_rl.layout.sizes import ParallelLayout

    cfg = load_config(None, ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=4"])
    validate(cfg, 2)
    assert ParallelLayout.from_config(cfg.parallel, 2).batch_p2p_comm is False
    assert ParallelLayout.from_config(load_config(None, ["parallel.pp=4"]).parallel, 4).batch_p2p_comm is True


@pytest.mark.parametrize("overrides,expected", [
    (["parallel.tpp=2"],
     "config error: parallel.tpp=2: unknown key (from the command line); fix: did you mean parallel.tp?"),
    (["parallel.tp=two"], "config error: parallel.tp=two: wrong type, expected an integer >= 1 and <= 2147483647; "
                          "fix: give an integer >= 1 and <= 2147483647"),
    (["parallel=2"],
     "config error: parallel=2: is a group of keys, not a value; fix: set one key, e.g. parallel.tp=..."),
    (["tp"], "config error: tp: an override must look like key=value; fix: write e.g. parallel.tp=2"),
])
def test_override_errors_are_one_exact_line(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value) == expected


def test_yaml_file_errors_name_the_file_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  tq: 2\n")
    with pytest.raises(ConfigError, match=r"parallel\.tq.*unknown key.*did you mean parallel\.tp"):
        load_config(str(bad))
    broken = tmp_path / "broken.yaml"
    broken.write_text("parallel: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(broken))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("configs/demo_cpu.yaml", ["actor.optim.lr=0.01"])
    path = tmp_path / "config.yaml"
    save_config(cfg, str(path))
    assert load_config(str(path)) == cfg


def test_every_preset_validates():
    import glob
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sorted(glob.glob(os.path.join(root, "configs", "*.yaml")))
    assert paths  # from any working directory
    for path in paths:
        cfg = load_config(path)
        validate(cfg, cfg.distributed.nproc if "cpu" in os.path.basename(path) else None)


def test_string_overrides_stay_strings():
    cfg = load_config(None, ["run.name=on", "data.tokenizer=null", "reward.fn=no", "run.dir=123"])
    assert cfg.run.name == "on" and cfg.data.tokenizer is None and cfg.reward.fn == "no" and cfg.run.dir == "123"


def test_a_mapping_override_replaces_the_files_mapping(tmp_path):
    """A command-line value of a mapping key is the value: ``teachers={}`` turns distillation off,
    ``{math: P}`` is the only teacher, not one added beside the file's."""
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  distill:\n    teachers: {default: /a, math: /b}\nreward:\n  kwargs: {x: 1}\n")
    assert load_config(str(path)).algorithm.distill.teachers == {"default": "/a", "math": "/b"}
    assert load_config(str(path), ["algorithm.distill.teachers={}"]).algorithm.distill.teachers == {}
    assert load_config(str(path), ["algorithm.distill.teachers={math: /c}"]).algorithm.distill.teachers == {
        "math": "/c"}
    assert load_config(str(path), ["reward.kwargs={y: 2}"]).reward.kwargs == {"y": 2}
    with pytest.raises(ConfigError, match=r"reward.kwargs=3: wrong type, expected a mapping"):
        load_config(str(path), ["reward.kwargs=3"])
