"""The same ``run.seed`` gives the same initial model on every layout, with megatron-core's own
distributions, and a run from random init gives the same numbers on every layout.  Loaded
weights are the ones the first update starts from, in bf16 too."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.testing.harness import run_distributed
from tests.support.helpers import TINY, ppo_body, read_metrics

MODEL = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
             vocab_size=61)


def _chunks(tp: int, pp: int, ep: int, tie: bool, experts: int | None, megatron_seed: int):
    from megatron_rl.config.schema import Config
    from megatron_rl.distributed.runtime import init_model_parallel
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.models.builder import build_gpt_chunks

    model = Config().model
    for key, value in MODEL.items():
        setattr(model, key, value)
    model.tie_word_embeddings = tie
    model.moe.num_experts = experts
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep)
    init_model_parallel(layout, seed=megatron_seed)
    return build_gpt_chunks(model, layout, torch.device("cpu"))


def seeded_body(tp, pp, ep, tie, experts, megatron_seed):
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.models.seeded_init import seeded_init

    chunks = _chunks(tp, pp, ep, tie, experts, megatron_seed)
    seeded_init(chunks, seed=99)
    return gather_canonical(chunks)


def megatron_body(experts):
    from megatron_rl.models.canonical import gather_canonical

    return gather_canonical(_chunks(1, 1, 1, False, experts, megatron_seed=5))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("experts", [None, 4])
def test_same_seed_same_weights_on_every_layout(tie, experts):
    """megatron's own seed differs between the runs (it must not matter); ``run.seed`` is the same."""
    one = run_distributed(1, seeded_body, 1, 1, 1, tie, experts, 3)[0]
    layouts = [(2, 1, 1), (1, 2, 1), (2, 2, 1)] + ([(1, 1, 2)] if experts else [])
    for tp, pp, ep in layouts:
        other = run_distributed(tp * pp * ep, seeded_body, tp, pp, ep, tie, experts, 11)[0]
        assert other.keys() == one.keys()
        for name in one:
            assert torch.equal(one[name], other[name]), (tp, pp, ep, name)


@pytest.mark.parametrize("experts", [None, 4])
def test_seeded_weights_follow_megatrons_distributions(experts):
    ours = run_distributed(1, seeded_body, 1, 1, 1, False, experts, 3)[0]
    theirs = run_distributed(1, megatron_body, experts)[0]
    assert ours.keys() == theirs.keys()
    for name, mine in ours.items():
        ref = theirs[name]
        if torch.equal(ref.flatten(), ref.flatten()[:1].expand(ref.numel())):
            assert torch.equal(mine, ref), name  # constants (norms, biases) are megatron's
            continue
        assert not torch.equal(mine, ref), name  # redrawn
        assert abs(float(mine.mean())) < 3 * float(ref.std()) / ref.numel() ** 0.5 + 1e-6, name
        if ref.numel() >= 256:
            assert float(mine.std()) == pytest.approx(float(ref.std()), rel=0.15), name


def _stable(rows):
    """What every layout must agree on: not times, and not per-rank memory (generation runs on the
    actor's shard of the rank, ``rollout/weights_gb``)."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/", "memory/"))
             and k != "rollout/weights_gb"} for r in rows]


@pytest.mark.slow
def test_a_run_from_random_init_gives_the_same_numbers_on_every_layout(tmp_path):
    common = ["trainer.steps=2", f"run.dir={tmp_path}"]
    run_distributed(1, ppo_body, common + ["run.name=one"])
    run_distributed(2, ppo_body, common + ["run.name=tp2", "parallel.tp=2"])
    run_distributed(2, ppo_body, common + ["run.name=pp2", "parallel.pp=2"])
    one = _stable(read_metrics(tmp_path / "one"))
    for name in ("tp2", "pp2"):
        other = _stable(read_metrics(tmp_path / name))
        assert [r["step"] for r in other] == [1, 2]
        for a, b in zip(one, other):
            for key, value in a.items():
                if isinstance(value, float):
                    assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (name, a["step"], key)
                else:
                    assert b[key] == value, (name, a["step"], key)


def checkpoint_parts_body(path):
    """Canonical weights of every part of the checkpoint at ``path`` (one process)."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.distributed.runtime import init_model_parallel
    from megatron_rl.engine.checkpoint import ModelPart, load_checkpoint
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.models.heads import attach_value_head

    cfg = load_config(None, TINY + ["model.params_dtype=bfloat16"])
    layout = ParallelLayout()
    init_model_parallel(layout)
    out = {}
    for part in ("actor", "critic", "reference"):
        chunks = build_gpt_chunks(cfg.model, layout, torch.device("cpu"))
        if part == "critic":
            chunks = attach_value_head(chunks)
        load_checkpoint(path, {part: ModelPart(chunks)}, with_optimizer=False, load_rng=False)
        out[part] = gather_canonical(chunks)
    return out


@pytest.mark.slow
def test_bf16_updates_start_from_the_loaded_weights(tmp_path):
    """bf16 keeps fp32 master weights in the optimizer: the critic (loaded from the actor) and the
    actor (seeded) must reach them, or the first step puts megatron's own init back.  With a
    learning rate of 1e-20 one step changes no bf16 weight: actor and critic still equal the
    reference, which holds the initial actor."""
    run_distributed(1, ppo_body, ["model.params_dtype=bfloat16", "trainer.steps=1", "actor.optim.lr=1e-20",
                                  "critic.optim.lr=1e-20", f"run.dir={tmp_path}", "run.name=r"])
    parts = run_distributed(1, checkpoint_parts_body, str(tmp_path / "r" / "checkpoints" / "step_00000001"))[0]
    reference = parts["reference"]
    for part in ("actor", "critic"):
        for name, value in parts[part].items():
            if name.startswith(("value_head.", "output_layer.")):
                continue  # the critic's own head; its unused LM head is not loaded
            assert torch.equal(value, reference[name]), (part, name)
