"""The actor update against megatron-core's own training step: the optimizer step does megatron's work
once, and ``benchmarks/update_vs_plain.py`` compares like with like (same weights, same loss).

Timings are the benchmark's to print, not a test's to assert: these tests check what the figures
stand on.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.testing.harness import run_distributed


def _nll_loss(outs: dict, tensors: dict, mb):
    mask = tensors["loss_mask"]
    return -(outs["logprob"] * mask).sum() / 64.0, {}


def _sequences(vocab: int):
    g = torch.Generator().manual_seed(3)
    seqs = []
    for n in (9, 17, 12, 5):
        mask = torch.zeros(n)
        mask[n // 3 : n - 1] = 1.0
        seqs.append({"tokens": torch.randint(0, vocab, (n,), generator=g), "loss_mask": mask})
    return seqs


def _step_body(dtype: str, clip: float):
    """Two identical models, the same gradients; one steps with Trainable.step, the other with
    megatron's own ``optimizer.step()``.  Returns whether every weight is bit-identical after three
    steps, the two runs' grad norms, and how often each computed the gradient norm per step."""
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.testing.layouts import use_layout

    model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        vocab_size=96, params_dtype=dtype)
    trainables = []
    for _ in range(2):
        layout = use_layout(seed=11)  # the same draw for both models
        chunks = build_gpt_chunks(model, layout, torch.device("cpu"))
        trainables.append(make_trainable(chunks, OptimConfig(lr=1e-3, clip_grad=clip), total_steps=10))
    ours, megatrons = trainables
    seqs = _sequences(model.vocab_size)
    plan = BatchPlan(max_tokens_per_rank=24, micro_batch_size=None, packed=True)
    calls = {"n": 0}
    original = megatron_optimizer.get_grad_norm_fp32

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    norms, counts = {"ours": [], "megatron": []}, {"ours": [], "megatron": []}
    megatron_optimizer.get_grad_norm_fp32 = counted
    try:
        for _ in range(3):
            for name, trainable in (("ours", ours), ("megatron", megatrons)):
                trainable.zero_grad()
                run_sequences(trainable.chunks, seqs, LogProbHead(with_entropy=False), plan, torch.device("cpu"),
                              loss_fn=_nll_loss, forward_only=False)
                calls["n"] = 0
                if name == "ours":
                    result = trainable.step()
                    assert result.ok
                    norms[name].append(result.grad_norm)
                else:
                    ok, norm, _ = trainable.optimizer.step()
                    assert ok
                    trainable.scheduler.step(increment=1)
                    norms[name].append(norm)  # None or 0.0 with clipping off
                counts[name].append(calls["n"])
    finally:
        megatron_optimizer.get_grad_norm_fp32 = original
    same = all(torch.equal(a, b) for a, b in zip(ours.chunks[0].parameters(), megatrons.chunks[0].parameters()))
    return same, norms, counts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("clip", [1e-3, 0.0])
def test_optimizer_step_is_megatrons_with_one_gradient_norm(dtype, clip):
    """Trainable.step (skips non-finite updates) gives megatron's ``optimizer.step()`` bit for bit,
    clipping on (every step clipped at 1e-3) and off, fp32 and bf16 (fp32 master weights), and
    computes the gradient norm once a step: before this, it prepared the gradients and computed
    their norm, then called megatron's ``step()``, which did both again (two passes over every
    gradient and two host reads a step)."""
    same, norms, counts = run_distributed(1, _step_body, dtype, clip)[0]
    assert same
    if clip:
        assert norms["ours"] == pytest.approx(norms["megatron"], rel=0, abs=0)
        assert all(n > clip for n in norms["ours"])  # the clip was active
    assert all(math.isfinite(n) for n in norms["ours"])
    print(f"gradient norms per step: ours {counts['ours']}, megatron's step() {counts['megatron']}")
    assert counts["ours"] == [1, 1, 1]


def _benchmark_body():
    from megatron_rl.testing.benchmarks import load_benchmark

    bench = load_benchmark("update_vs_plain")
    args = bench.parse(["--model", "tiny", "--tokens-per-microbatch", "128", "--seq-len", "24", "--rounds", "1",
                       "--build-and-load"])
    bench.init_world(torch.device("cpu"))
    setup = bench.build_setup(args, torch.device("cpu"))
    out = bench.report(args, setup, bench.measure(args, setup, log=lambda *a, **k: None))
    return out, len(setup.groups), bench.PLAIN, bench.RL_PIECES, bench.RECOMPUTED, bench.FORWARDS


def test_update_benchmark_compares_the_same_loss_on_the_same_weights():
    """benchmarks/update_vs_plain.py: our -mean log-prob equals megatron's cross-entropy loss on the
    same micro-batches (the two models start from the same weights), every row is timed, and the
    build + load comparison restores our weights exactly."""
    out, microbatches, plain, pieces, recomputed, forwards = run_distributed(1, _benchmark_body)[0]
    assert microbatches >= 2
    assert out["loss_parity"] <= 1e-5
    names = [row[0] for row in out["rows"]]
    assert names == [plain, *pieces, recomputed]
    assert [row[0] for row in out["forward_rows"]][1:] == list(forwards)
    for _, seconds, tokens_per_s, ratio in out["rows"] + out["forward_rows"]:
        assert seconds > 0 and tokens_per_s > 0 and ratio > 0
    assert out["update_ratio"] > 0 and out["build_s"]["ours"] > 0
    loads = out["build_and_load_s"]
    assert loads["ours_weights_equal"] and loads["ours"] > 0 and loads["megatron"] > 0
