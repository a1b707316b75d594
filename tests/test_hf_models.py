"""Megatron models built from Hugging Face checkpoints compute what HF transformers computes.

Tiny Llama / Qwen2 / Qwen3 / Mistral checkpoints are created with random weights by
``tests/support/helpers.py`` (no downloads).  `score` on each parallel layout must reproduce HF's
per-token log-probs in fp32; the bridge must round-trip HF -> Megatron (TP2xPP2) -> HF bit-exactly;
the critic's values must not depend on the layout, and its value head must get the same gradient on
every TP rank.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megatron_rl.testing.cli_runner import run_cli
from megatron_rl.testing.harness import run_distributed
from tests.support.helpers import (
    ARCHS,
    COMMON,
    check_scores,
    hf_logprobs,
    hf_logprobs_in_a_fresh_process,
    make_hf_model,
    roundtrip_body,
    score_body,
    scored_gap,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {
    "tp1": (1, []),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
    "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2"]),
}
LENGTHS = (37, 5, 64, 2, 23)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]
    out = {}
    for kind in ARCHS:
        path = str(root / kind)
        model = make_hf_model(kind, path)
        with open(os.path.join(path, "in.jsonl"), "w") as fh:
            for ids in sequences:
                fh.write(json.dumps({"input_ids": ids}) + "\n")
        out[kind] = (path, [hf_logprobs(model, ids) for ids in sequences])
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_score_matches_hf_transformers(hf_models, kind, layout, tmp_path):
    hf_dir, reference = hf_models[kind]
    world, overrides = LAYOUTS[layout]
    worst = scored_gap(world, hf_dir, overrides + ["batch.micro_batch_size=2"], reference, tmp_path)
    print(f"{kind} {layout}: max |logprob - HF| = {worst:.2e}")
    assert worst <= 1e-4


@pytest.mark.parametrize("kind", ["mistral", "llama3_rope"])
def test_more_architectures_match_hf(hf_models, kind, tmp_path):
    hf_dir, reference = hf_models[kind]
    out = str(tmp_path / "out.jsonl")
    run_distributed(2, score_body, hf_dir, ["parallel.tp=2", "parallel.sequence_parallel=true"], out)
    worst = check_scores(out, reference)
    print(f"{kind} tp2_sp: max |logprob - HF| = {worst:.2e}")
    assert worst <= 1e-4


# YaRN on every kind of layout: tensor, pipeline (interleaved) and context parallel (ring packed,
# all_gather unpadded, a2a), the sequences up to 4x the 16 positions the model was pretrained on.
YARN_LAYOUTS = {
    "tp1": (1, ["batch.micro_batch_size=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2", "batch.micro_batch_size=2"]),
    "cp2": (2, ["parallel.cp=2", "batch.micro_batch_size=3"]),
    "cp2_all_gather_unpacked": (2, ["parallel.cp=2", "parallel.cp_comm_type=all_gather", "batch.packing=false",
                                    "batch.micro_batch_size=2"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_comm_type=a2a", "batch.max_tokens_per_rank=48"]),
    "tp2_cp2_sp": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true",
                       "batch.max_tokens_per_rank=32"]),
}


@pytest.mark.parametrize("layout", list(YARN_LAYOUTS))
def test_yarn_matches_hf_on_every_layout(hf_models, layout, tmp_path):
    hf_dir, reference = hf_models["qwen2_yarn"]
    world, overrides = YARN_LAYOUTS[layout]
    worst = scored_gap(world, hf_dir, overrides, reference, tmp_path)
    print(f"qwen2 yarn {layout}: max |logprob - HF| = {worst:.2e}")
    assert worst <= 1e-4


@pytest.mark.parametrize("change", [{"rope_scaling": None}, {"attention_factor": 1.0}])
def test_yarn_reference_depends_on_frequencies_and_attention_factor(hf_models, change, tmp_path):
    """The YaRN model's log-probs move far past the parity tolerance without YaRN's frequencies
    or without its attention factor, so the layout tests above see either one go missing."""

    hf_dir, reference = hf_models["qwen2_yarn"]
    changed = str(tmp_path / "changed")
    shutil.copytree(hf_dir, changed)
    with open(os.path.join(changed, "config.json")) as fh:
        config = json.load(fh)
    rope = dict(config["rope_parameters"])
    if "rope_scaling" in change:
        rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
        config.pop("rope_scaling", None)
    else:
        rope.update(change)
    config["rope_parameters"] = rope
    with open(os.path.join(changed, "config.json"), "w") as fh:
        json.dump(config, fh)
    ids = [json.loads(line)["input_ids"] for line in open(os.path.join(hf_dir, "in.jsonl"))]
    got = hf_logprobs_in_a_fresh_process(changed, ids)
    worst = max(float((g - ref).abs().max()) for g, ref in zip(got, reference) if len(ref))
    print(f"{change}: max |logprob - YaRN| = {worst:.2e}")
    assert worst > 1e-2


def test_unpacked_and_token_budget_batches_match_hf(hf_models, tmp_path):
    hf_dir, reference = hf_models["llama"]
    for extra in (["batch.packing=false", "batch.micro_batch_size=3"], ["batch.max_tokens_per_rank=70"]):
        out = str(tmp_path / "out.jsonl")
        run_distributed(2, score_body, hf_dir, ["parallel.pp=2"] + extra, out)
        assert check_scores(out, reference) <= 1e-4, extra


@pytest.mark.slow
def test_score_command_line(hf_models, tmp_path):
    hf_dir, reference = hf_models["qwen2"]
    out = tmp_path / "cli.jsonl"
    proc = run_cli("score", "--hf-model", hf_dir, "--input", os.path.join(hf_dir, "in.jsonl"), "--output", str(out),
                   "--nproc", "2", "parallel.tp=2")
    assert proc.returncode == 0, proc.stderr
    assert check_scores(str(out), reference) <= 1e-4


def test_score_rejects_bad_input_line(hf_models, tmp_path):
    hf_dir, _ = hf_models["llama"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 999]}\n')
    proc = run_cli("score", "--hf-model", hf_dir, "--input", str(bad), "--output", str(tmp_path / "o.jsonl"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"data error: {bad}:2=999: token id outside")


# ----------------------------------------------------------------------------- bridge round trip


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_hf_megatron_hf_round_trip_is_bit_exact(hf_models, kind, tmp_path):
    from safetensors.torch import load_file

    hf_dir, _ = hf_models[kind]
    out_dir = str(tmp_path / "export")
    bytes_read = run_distributed(4, roundtrip_body, hf_dir, out_dir, dict(tp=2, pp=2))
    before = load_file(os.path.join(hf_dir, "model.safetensors"))
    after = load_file(os.path.join(out_dir, "model.safetensors"))
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype and before[name].shape == after[name].shape, name
        assert torch.equal(before[name].view(torch.uint8), after[name].view(torch.uint8)), name
    with open(os.path.join(hf_dir, "config.json")) as a, open(os.path.join(out_dir, "config.json")) as b:
        assert json.load(a) == json.load(b)
    total = sum(t.numel() * t.element_size() for t in before.values())
    print(f"{kind}: bytes read per rank {[round(b / total, 3) for b in bytes_read]} of the model")
    # No rank reads the whole model: each holds half the layers and half of each layer.
    assert max(bytes_read) < 0.6 * total


# ----------------------------------------------------------------------------- critic


def critic_body(hf_dir: str, layout_kw: dict, head_weights: dict):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import load_canonical
    from megatron_rl.models.heads import ValueOutput, attach_value_head
    from megatron_rl.models.hf_bridge import load_hf_weights
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(**layout_kw)
    cfg = model_config_from_hf(read_hf_config(hf_dir), ModelConfig())
    chunks = attach_value_head(build_gpt_chunks(cfg, layout, torch.device("cpu")))
    load_hf_weights(chunks, hf_dir)
    load_canonical(chunks, head_weights, strict=False)
    trainable = make_trainable(chunks, OptimConfig(), total_steps=1)
    g = torch.Generator().manual_seed(3)
    seqs = [{"tokens": torch.randint(0, 250, (n,), generator=g), "target": torch.randn(n, generator=g)}
            for n in (9, 30, 17, 4)]
    total = float(sum(s["tokens"].numel() for s in seqs))

    def loss_fn(outs, tensors, mb):
        err = (outs["value"] - tensors["target"]) ** 2
        return (err * _real(mb, err)).sum() / total, {}

    trainable.zero_grad()
    outs, _ = run_sequences(trainable.chunks, seqs, ValueOutput(), BatchPlan(micro_batch_size=2), torch.device("cpu"),
                            loss_fn=loss_fn, forward_only=False)
    grads = None
    for chunk in trainable.chunks:
        head = getattr(chunk.module, "value_head", None)
        if head is not None:
            grads = torch.cat([head.linear.weight.main_grad.reshape(-1), head.linear.bias.main_grad.reshape(-1)])
    return {"values": [o["value"] for o in outs], "head_grad": grads,
            "tp_rank": ps.get_tensor_model_parallel_rank(), "rank": dist.get_rank()}


def _real(mb, like):
    """1 on real tokens, 0 on padding, shaped like this rank's micro-batch shard."""
    from megatron_rl.ops import zigzag

    parts = []
    for n, p in zip(mb.lengths, mb.padded_lengths):
        parts.append(zigzag.shard(torch.cat([torch.ones(n), torch.zeros(p - n)]), mb.cp_size, mb.cp_rank, 0))
    return torch.cat(parts).reshape(like.shape) if mb.packed else torch.stack(parts).reshape(like.shape)


def test_critic_values_and_head_gradient_do_not_depend_on_layout(hf_models):
    hf_dir, _ = hf_models["llama"]
    g = torch.Generator().manual_seed(5)
    head = {"value_head.linear.weight": torch.randn(1, 64, generator=g) * 0.2,
            "value_head.linear.bias": torch.tensor([0.3])}
    ref = run_distributed(1, critic_body, hf_dir, {}, head)[0]
    assert ref["head_grad"].abs().max() > 1e-3
    for world, layout in ((2, dict(tp=2, sp=True)), (2, dict(pp=2)), (4, dict(tp=2, pp=2, sp=True))):
        results = run_distributed(world, critic_body, hf_dir, layout, head)
        for r in results:
            worst = max(float((a - b).abs().max()) for a, b in zip(r["values"], ref["values"]))
            assert worst <= 1e-5, (layout, worst)
        head_grads = [r["head_grad"] for r in results if r["head_grad"] is not None]
        assert head_grads, layout
        for grad in head_grads:  # identical on every TP rank, and equal to one process
            assert (grad - ref["head_grad"]).abs().max() <= 1e-5, (layout, grad, ref["head_grad"])


@pytest.mark.slow
def test_convert_command_both_directions(hf_models, tmp_path):
    """HF -> megatron_rl checkpoint on TP2 -> HF on PP2: the tensors come back bit-exact."""
    from safetensors.torch import load_file

    hf_dir, _ = hf_models["qwen3"]

    def cli(*args):
        proc = run_cli("convert", *args)
        assert proc.returncode == 0, proc.stderr
        return proc

    cli("--hf-model", hf_dir, "--out", str(tmp_path / "ckpt"), "--nproc", "2", "parallel.tp=2")
    step = tmp_path / "ckpt" / "step_00000000"
    assert (step / "meta.json").is_file() and (tmp_path / "ckpt" / "latest").read_text().strip() == step.name
    cli("--checkpoint", str(step), "--hf-out", str(tmp_path / "back"), "--nproc", "2", "parallel.pp=2")
    before = load_file(os.path.join(hf_dir, "model.safetensors"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "back" / "config.json").is_file()
