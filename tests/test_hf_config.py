"""HF ``rope_scaling`` in and out of our config, and the position limit checked before launch.

YaRN's frequencies and attention factor are compared with HF transformers' own computation; the
model-level parity (every layout) is in ``tests/test_hf_models.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_rl.config.model_io import model_config_from_dict, model_config_to_dict
from megatron_rl.config.schema import ModelConfig, RopeScalingConfig
from megatron_rl.errors import ConfigError
from megatron_rl.layout.arch import max_positions, rope_inv_freq
from megatron_rl.models.hf_config import hf_config_with_rope_scaling, model_config_from_hf
from megatron_rl.tools.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")
QWEN2 = dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6,
             hidden_act="silu", tie_word_embeddings=True)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

# rope_scaling variants HF accepts for yarn: defaults, both mscales (ratio), one mscale only (HF
# ignores it), untruncated correction range, other betas, and the legacy "type" key.
YARN_VARIANTS = {
    "defaults": YARN,
    "mscale_ratio": dict(YARN, mscale=0.707, mscale_all_dim=0.3),
    "mscale_alone": dict(YARN, mscale=0.707),
    "untruncated": dict(YARN, truncate=False),
    "betas": dict(YARN, beta_fast=16, beta_slow=2),
    "legacy_type_key": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8},
}


def _hf_rope(scaling: dict, **extra):
    """HF transformers' (inverse frequencies, attention factor) for a Qwen2 config with ``scaling``."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.Qwen2Config(**{**QWEN2, **extra, "rope_scaling": dict(scaling)})
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


@pytest.mark.parametrize("variant", list(YARN_VARIANTS))
def test_yarn_frequencies_and_attention_factor_match_hf(variant):
    scaling = YARN_VARIANTS[variant]
    cfg = model_config_from_hf(dict(QWEN2, rope_scaling=scaling))
    assert cfg.rope_scaling.type == "yarn" and cfg.rope_scaling.factor == scaling["factor"]
    ours, factor = rope_inv_freq(16, int(cfg.rotary_base), cfg)
    ref, ref_factor = _hf_rope(scaling)
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0), (ours, ref)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    assert not torch.allclose(ours, rope_inv_freq(16, int(cfg.rotary_base), ModelConfig())[0])


def test_yarn_original_window_defaults_to_max_position_embeddings():
    cfg = model_config_from_hf(dict(QWEN2, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    assert cfg.rope_scaling.original_max_position_embeddings is None and max_positions(cfg) == 128
    ours, factor = rope_inv_freq(16, int(cfg.rotary_base), cfg)
    ref, ref_factor = _hf_rope({"rope_type": "yarn", "factor": 2.0})
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0) and factor == pytest.approx(ref_factor)


@pytest.mark.parametrize("scaling,words", [
    ({"rope_type": "linear", "factor": 2.0}, "RoPE scaling type 'linear' is not supported (llama3 and yarn are)"),
    ({"type": "dynamic", "factor": 2.0}, "RoPE scaling type 'dynamic' is not supported"),
    (dict(YARN, attention_factor=1.0), "megatron-core's YaRN derives the attention factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}, "only Llama-3 RoPE scaling with"),
])
def test_unsupported_rope_scaling_is_one_config_error(scaling, words):
    with pytest.raises(ConfigError) as err:
        model_config_from_hf(dict(QWEN2, rope_scaling=scaling))
    line = str(err.value)
    assert line.startswith("config error: model.hf_path=rope_scaling") and words in line and "; fix: " in line
    assert "\n" not in line


def test_yarn_from_the_yaml_stands_when_config_json_has_none():
    """How Qwen2.5 is run past 32k: its config.json has no rope_scaling, the YAML sets YaRN."""
    yaml = ModelConfig(rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=64))
    cfg = model_config_from_hf(QWEN2, yaml)
    assert cfg.rope_scaling == yaml.rope_scaling and max_positions(cfg) == 256
    assert model_config_from_hf(dict(QWEN2, rope_scaling=dict(YARN, original_max_position_embeddings=64)),
                                yaml).rope_scaling == yaml.rope_scaling  # both, agreeing
    with pytest.raises(ConfigError, match=r"^config error: model.rope_scaling=yarn: differs from config.json"):
        model_config_from_hf(dict(QWEN2, rope_scaling=YARN), yaml)


def test_checkpoint_meta_keeps_rope_scaling_and_reads_the_old_key():
    cfg = ModelConfig(rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=16))
    assert model_config_from_dict(json.loads(json.dumps(model_config_to_dict(cfg)))) == cfg
    old = model_config_to_dict(ModelConfig())
    del old["rope_scaling"]
    old["rope_scaling_factor"] = 8.0  # meta.json written before model.rope_scaling existed
    assert model_config_from_dict(old).rope_scaling == RopeScalingConfig(type="llama3", factor=8.0)


def test_export_writes_the_yaml_rope_scaling_into_config_json():
    import transformers

    yaml = ModelConfig(rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=64))
    for hf in (QWEN2, dict(QWEN2, rope_scaling=None),  # transformers 4 style
               dict({k: v for k, v in QWEN2.items() if k != "rope_theta"},
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})):  # transformers 5 style
        cfg = model_config_from_hf(hf, yaml)
        out = hf_config_with_rope_scaling(hf, cfg)
        assert model_config_from_hf(out).rope_scaling == yaml.rope_scaling, out
        assert hf_config_with_rope_scaling(out, cfg) is out  # already describes it: left as it is
        config = transformers.Qwen2Config(**{k: v for k, v in out.items() if k != "model_type"})
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        ref, _ = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        assert torch.allclose(rope_inv_freq(16, 1000000, cfg)[0], ref.float(), rtol=1e-6, atol=0)
    plain = model_config_from_hf(QWEN2)
    assert hf_config_with_rope_scaling(QWEN2, plain) is QWEN2


def test_yarn_round_trips_through_convert(tmp_path):
    """HF (YaRN) -> megatron on TP2 -> HF: same tensors, same config.json."""
    from safetensors.torch import load_file

    from megatron_rl.testing.harness import run_distributed
    from tests.support.helpers import make_hf_model, roundtrip_body

    hf_dir, out_dir = str(tmp_path / "hf"), str(tmp_path / "out")
    make_hf_model("qwen2_yarn", hf_dir)
    run_distributed(2, roundtrip_body, hf_dir, out_dir, dict(tp=2))
    before, after = load_file(f"{hf_dir}/model.safetensors"), load_file(f"{out_dir}/model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with open(f"{hf_dir}/config.json") as a, open(f"{out_dir}/config.json") as b:
        assert json.load(a) == json.load(b)


def export_body(hf_dir: str, out_dir: str, overrides: list[str]):
    """Harness body: the HF model with the YAML's ``overrides`` -> megatron -> HF into ``out_dir``."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.hf_bridge import export_hf, load_hf_weights
    from megatron_rl.models.hf_config import read_hf_config
    from megatron_rl.testing.layouts import use_layout

    hf = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf, load_config(None, overrides).model)
    chunks = build_gpt_chunks(cfg, use_layout(), torch.device("cpu"))
    load_hf_weights(chunks, hf_dir)
    export_hf(chunks, out_dir, hf, cfg, source_dir=hf_dir)


def test_yarn_enabled_in_the_yaml_is_exported_and_hf_runs_it_alike(tmp_path):
    """A checkpoint whose config.json has no rope_scaling, run with YaRN from the YAML (as Qwen2.5
    past 32k): HF transformers, loading the exported directory, computes our log-probs."""

    from megatron_rl.testing.harness import run_distributed
    from tests.support.helpers import check_scores, hf_logprobs_in_a_fresh_process, make_hf_model, score_body

    hf_dir, out_dir = str(tmp_path / "hf"), str(tmp_path / "out")
    make_hf_model("qwen2_yarn", hf_dir)
    with open(f"{hf_dir}/config.json") as fh:
        config = json.load(fh)
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    with open(f"{hf_dir}/config.json", "w") as fh:
        json.dump(config, fh)
    g = torch.Generator().manual_seed(4)
    sequences = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (64, 40, 9)]
    with open(f"{hf_dir}/in.jsonl", "w") as fh:
        fh.writelines(json.dumps({"input_ids": ids}) + "\n" for ids in sequences)
    yarn = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
            "model.rope_scaling.original_max_position_embeddings=16"]
    run_distributed(1, export_body, hf_dir, out_dir, yarn)
    with open(os.path.join(out_dir, "config.json")) as fh:
        assert json.load(fh)["rope_parameters"]["rope_type"] == "yarn"
    out = str(tmp_path / "scores.jsonl")
    run_distributed(2, score_body, hf_dir, yarn + ["parallel.cp=2"], out)
    assert check_scores(out, hf_logprobs_in_a_fresh_process(out_dir, sequences)) <= 1e-4
    # the same weights without YaRN
    assert check_scores(out, hf_logprobs_in_a_fresh_process(hf_dir, sequences)) > 1e-2


# ----------------------------------------------------------------------------- position limit


def _validate(capsys, tmp_path, *overrides: str) -> tuple[int, str]:
    code = main(["validate", DEMO, "--world-size", "4", f"run.dir={tmp_path}/runs", *overrides])
    return code, capsys.readouterr().err.strip()


def test_position_limit_is_checked_before_launch(capsys, tmp_path):
    # demo: 64 positions, prompts up to 16 tokens
    code, err = _validate(capsys, tmp_path, "rollout.max_new_tokens=49")
    assert code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "runs").exists()
    assert err.startswith("config error: rollout.max_new_tokens=49: data.max_prompt_tokens 16 + "
                          "rollout.max_new_tokens 49 = 65 tokens exceed the model's 64 positions "
                          "(model.max_position_embeddings 64); fix: enable YaRN (model.rope_scaling.type=yarn, "
                          "model.rope_scaling.factor=2, model.rope_scaling.original_max_position_embeddings=64;"), err
    assert _validate(capsys, tmp_path, "rollout.max_new_tokens=48")[0] == 0
    # the fix it names works, and YaRN's own window is checked in turn
    yarn = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=2",
            "model.rope_scaling.original_max_position_embeddings=64"]
    assert _validate(capsys, tmp_path, "rollout.max_new_tokens=49", *yarn)[0] == 0
    code, err = _validate(capsys, tmp_path, "rollout.max_new_tokens=113", *yarn)
    assert code == 2 and "exceed the model's 128 positions (YaRN factor 2 x original_max_position_embeddings 64" in err
    assert "fix: raise model.rope_scaling.factor, or lower data.max_prompt_tokens / rollout.max_new_tokens" in err
    code, err = _validate(capsys, tmp_path, "model.rope_scaling.type=yarn")
    assert code == 2 and err.startswith("config error: model.rope_scaling.factor: RoPE scaling type yarn needs a "
                                        "factor; fix: set model.rope_scaling.factor"), err
    code, err = _validate(capsys, tmp_path, "model.rope_scaling.type=linear")
    assert code == 2 and "model.rope_scaling.type" in err and "none, llama3, yarn" in err, err


def test_position_limit_reads_the_hf_model(capsys, tmp_path):
    """With model.hf_path the limit is config.json's: native, or its YaRN window."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    for scaling, ok in ((None, False), (dict(YARN, original_max_position_embeddings=32), True)):
        (hf_dir / "config.json").write_text(json.dumps(dict(QWEN2, rope_scaling=scaling)))
        code, err = _validate(capsys, tmp_path, f"model.hf_path={hf_dir}", "data.tokenizer=char",
                              "rollout.max_new_tokens=48", "data.max_prompt_tokens=17")
        assert (code == 0) == ok, err
        if not ok:
            assert "exceed the model's 64 positions (model.max_position_embeddings 64)" in err


def test_shipped_32k_recipes_use_yarn_past_the_native_window():
    from megatron_rl.config.loader import load_config

    for name in ("qwen2.5_7b_32k", "dapo_qwen2.5_7b_32k", "gspo_qwen2.5_7b_32k", "reinforce_pp_qwen2.5_7b_32k"):
        cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
        qwen = model_config_from_hf(dict(QWEN2, max_position_embeddings=32768), cfg.model)  # its config.json
        assert qwen.rope_scaling == RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32768)
        assert cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens > 32768 and max_positions(qwen) == 131072
