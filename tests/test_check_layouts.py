"""``megatron-rl check-layouts``: random layouts of the user's model, each compared with one process."""

from __future__ import annotations

import types

import pytest

from tests.support.helpers import TINY


def _args(**kw):
    base = dict(layouts=2, seed=3, steps=2, world=2)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.slow  # about 85 s on 2 cores: a reference and a 2-rank run per layout, 2 steps each
def test_command_checks_two_layouts_of_a_tiny_config_and_prints_the_table(capsys):
    """Two layouts, two training steps each, on two CPU ranks: every row within the tolerance, exit 0."""
    from megatron_rl.tools.cli import main

    code = main(["check-layouts", "--layouts", "2", "--seed", "3", "--world", "2", *TINY])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("#"))
    for column in ("layout", "loss", "logprob", "grad-norm", "weights", "tol", "verdict"):
        assert column in lines[head], lines[head]
    rows = lines[head + 1 : head + 3]
    assert len(rows) == 2 and all(row.rstrip().endswith("ok") for row in rows), out
    assert "seed 3" in out and "verdict: all 2 layouts match one process" in out


@pytest.mark.parametrize("argv,key", [
    (["--layouts", "0"], "--layouts"),
    (["--world", "1"], "--world"),
    (["model.num_layers=0"], "model.num_layers"),
])
def test_bad_input_exits_2_with_one_line_naming_the_key(capsys, argv, key):
    from megatron_rl.tools.cli import main

    assert main(["check-layouts", *TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and "fix:" in err, err


def test_a_layout_beyond_the_tolerance_or_failing_fails_the_verdict():
    """The verdict is the rows': one difference past the tolerance, or one failed layout, is exit 1's."""
    from megatron_rl.testing.layout_parity import model_config
    from megatron_rl.tools.check_layouts import LayoutResult, table
    from megatron_rl.tools.layout_draw import LayoutDraw

    draw = LayoutDraw(dict(tp=2, pp=1, cp=1, sp=True), dict(micro_batch_size=2), model_config(), dict(lr=0.01))
    good = LayoutResult(draw, dict(loss=1e-7, logprob=2e-6, weights=3e-6, grads=None))
    far = LayoutResult(draw, dict(loss=1e-7, logprob=2e-6, weights=3e-4, grads=None))
    broken = LayoutResult(draw, {}, error="RankError: boom")
    assert good.ok and not far.ok and not broken.ok
    lines = table([good, far, broken])
    assert lines[2].endswith("ok") and lines[3].endswith("DIFFERS") and lines[4].endswith("FAILED")
    assert " tp=2 sp " in lines[2] and "layout 2 failed: RankError: boom" in lines
    assert lines[-1] == "verdict: 2 of 3 layouts differ from one process or fail"


def test_the_shrunk_model_keeps_the_models_kinds():
    from megatron_rl.config.schema import ModelConfig, MoEConfig
    from megatron_rl.tools.layout_draw import shrink_model

    big = ModelConfig(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                      num_query_groups=4, kv_channels=128, vocab_size=151936, normalization="LayerNorm",
                      activation="gelu", qk_layernorm=True, tie_word_embeddings=True, rotary_base=1e6,
                      params_dtype="bfloat16", moe=MoEConfig(num_experts=128, router_topk=8, ffn_hidden_size=768,
                                                              dense_layers=[0, 47]))
    small = shrink_model(big)
    assert (small.num_layers, small.hidden_size, small.vocab_size, small.params_dtype) == (4, 64, 100, "float32")
    assert small.num_attention_heads // small.num_query_groups == 4  # GQA ratio 8, capped at 4
    assert small.num_query_groups == 2 and small.kv_channels == 32
    assert (small.normalization, small.activation, small.qk_layernorm, small.tie_word_embeddings,
            small.rotary_base) == ("LayerNorm", "gelu", True, True, 1e6)
    assert small.moe.num_experts == 4 and small.moe.router_topk == 2 and small.moe.ffn_hidden_size == 64
    assert small.moe.dense_layers == [0]
    dense = shrink_model(ModelConfig(num_attention_heads=16, num_query_groups=16))
    assert dense.num_query_groups is None and dense.moe.num_experts is None
    assert big.num_layers == 48  # the user's config is left as it was


def test_every_drawn_layout_is_one_validate_accepts_and_fills_the_world():
    from megatron_rl.config.loader import load_config
    from megatron_rl.tools.check_layouts import draw_layouts
    from megatron_rl.tools.layout_draw import layout_config
    from megatron_rl.validation import validate

    cfg = load_config(None, TINY + ["model.moe.num_experts=4", "model.moe.router_topk=2"])
    draws = draw_layouts(cfg, 4, 12, seed=5)
    assert any(d.layout.get("ep", 1) > 1 for d in draws)  # the MoE model's layouts use expert parallelism
    for d in draws:
        validate(layout_config(cfg, d, 4), 4, generates=False)
        assert 4 % (d.layout["tp"] * d.layout["pp"] * d.layout["cp"]) == 0
    assert [d.layout for d in draw_layouts(cfg, 4, 3, seed=5)] == [d.layout for d in draws[:3]]  # seeded
