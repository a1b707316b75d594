"""Every parallel layout computes what one process computes.

A seeded tiny GPT (TP=1, PP=1) runs one training step on one process; its weights are then
loaded into each layout, which runs the same step on the same global batch.  Loss and every
parameter's gradient (gathered to canonical, layout-independent form) must agree to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.testing.harness import run_distributed

TOL = 1e-5
MODEL = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
             num_query_groups=2, vocab_size=100)
SEQ_LEN, SEQS = 32, 8


def lm_step(layout_kw, model_kw, weights, micro_batch_size, do_step, distributed_optimizer=False):
    """One LM training step on this worker's layout; returns loss, canonical grads (and params)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.distributed.metrics import reduce_sum_count
    from megatron_rl.engine.pipeline import run_microbatches
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical, load_canonical
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.tools.smoke import data_parallel_slice, lm_forward_step, lm_microbatches, synthetic_sequences

    layout = use_layout(**layout_kw)
    model_cfg = ModelConfig(**model_kw)
    chunks = build_gpt_chunks(model_cfg, layout, torch.device("cpu"))
    if weights is None:
        weights = gather_canonical(chunks)
    else:
        load_canonical(chunks, weights)
    # adam_eps well above the gradients' rounding noise: Adam's first step divides by |g| + eps, so
    # with the default 1e-8 a ~1e-9 gradient turns a 1e-16 layout difference into a 1e-5 update.
    trainable = make_trainable(chunks, OptimConfig(lr=1e-2, clip_grad=0.0, adam_eps=1e-4,
                                                   use_distributed_optimizer=distributed_optimizer),
                               total_steps=1)
    tokens = synthetic_sequences(0, SEQS, SEQ_LEN, model_cfg.vocab_size, seed=7)
    mbs = lm_microbatches(data_parallel_slice(tokens), micro_batch_size, layout.cp,
                          ps.get_context_parallel_rank())
    trainable.zero_grad()
    logs = run_microbatches(trainable.chunks, mbs, lm_forward_step(torch.device("cpu")),
                            forward_only=False, seq_length=SEQ_LEN // layout.cp,
                            micro_batch_size=micro_batch_size)
    out = {"loss": reduce_sum_count(logs, ["lm_loss"])["lm_loss"],
           "grads": gather_canonical(trainable.chunks, "grad"), "weights": weights}
    if do_step:
        trainable.step()
        out["params"] = gather_canonical(trainable.chunks)
    return out if dist.get_rank() == 0 else None


_REFERENCE: dict = {}


def reference(model_kw=None, micro_batch_size=SEQS, do_step=False):
    model_kw = model_kw or MODEL
    key = (tuple(sorted(model_kw.items())), micro_batch_size, do_step)
    if key not in _REFERENCE:
        _REFERENCE[key] = run_distributed(1, lm_step, {}, model_kw, None, micro_batch_size, do_step)[0]
    return _REFERENCE[key]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def check_layout(world, layout_kw, micro_batch_size=2, model_kw=None, do_step=False, distributed_optimizer=False):
    ref = reference(model_kw, do_step=do_step)
    got = run_distributed(world, lm_step, layout_kw, model_kw or MODEL, ref["weights"],
                          micro_batch_size, do_step, distributed_optimizer)[0]
    loss_diff = abs(got["loss"] - ref["loss"])
    # The distributed optimizer reduce-scatters: a rank holds the summed gradient of its shard
    # only, so there the parameters after the step are what must match.
    grad_diff = 0.0 if distributed_optimizer else max_diff(got["grads"], ref["grads"])
    print(f"{layout_kw}: loss {got['loss']:.6f} |dloss| {loss_diff:.2e} max|dgrad| {grad_diff:.2e}")
    assert loss_diff <= TOL
    assert grad_diff <= TOL
    # Gradients are not trivially zero: the comparison means something.
    assert max(float(g.abs().max()) for g in ref["grads"].values()) > 1e-3
    if do_step:
        param_diff = max_diff(got["params"], ref["params"])
        print(f"  max|dparam| after the optimizer step {param_diff:.2e}")
        assert param_diff <= TOL
        assert max_diff(ref["params"], ref["weights"]) > 1e-3  # the step moved the weights
    return got


def test_tp2_sequence_parallel():
    check_layout(2, dict(tp=2, sp=True))


def test_pp2_1f1b_four_microbatches():
    # 8 sequences, 2 per micro-batch: 4 micro-batches through the 1F1B schedule.
    check_layout(2, dict(pp=2), micro_batch_size=2)


def test_pp2_vpp2():
    check_layout(2, dict(pp=2, vpp=2), micro_batch_size=2)


def test_dp2_ddp_optimizer_step():
    check_layout(2, dict(), micro_batch_size=2, do_step=True)


def test_dp2_distributed_optimizer_step():
    """Adam state sharded over the two data-parallel ranks; the step equals one process's."""
    check_layout(2, dict(), micro_batch_size=2, do_step=True, distributed_optimizer=True)


def test_tp2_pp2():
    check_layout(4, dict(tp=2, pp=2, sp=True), micro_batch_size=2)


@pytest.mark.parametrize("recompute", [
    dict(granularity="full", method="uniform", num_layers=1),
    dict(granularity="full", method="block", num_layers=1),
    dict(granularity="selective", modules=["core_attn"]),
])
def test_recompute_full_and_selective_match(recompute):
    """Recompute must not change the numbers, on a TP2+SP layout where its RNG handling matters."""
    from megatron_rl.config.schema import RecomputeConfig

    model_kw = dict(MODEL, recompute=RecomputeConfig(**recompute))
    ref = reference()
    got = run_distributed(2, lm_step, dict(tp=2, sp=True), model_kw, ref["weights"], 2, False)[0]
    assert abs(got["loss"] - ref["loss"]) <= TOL
    assert max_diff(got["grads"], ref["grads"]) <= TOL


def test_tied_embeddings_pp2_keep_one_weight():
    """Tied input/output embeddings across pipeline stages: megatron syncs their gradients."""
    model_kw = dict(MODEL, tie_word_embeddings=True)
    ref = run_distributed(1, lm_step, {}, model_kw, None, SEQS, False)[0]
    got = run_distributed(2, lm_step, dict(pp=2), model_kw, ref["weights"], 2, False)[0]
    assert "output_layer.weight" not in ref["grads"]
    assert abs(got["loss"] - ref["loss"]) <= TOL
    assert max_diff(got["grads"], ref["grads"]) <= TOL


def nonfinite_step_body():
    """A step whose gradients hold a NaN is skipped and reported; the weights stay as they were."""
    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(tp=2)
    chunks = build_gpt_chunks(ModelConfig(**MODEL), layout, torch.device("cpu"))
    trainable = make_trainable(chunks, OptimConfig(lr=1e-2), total_steps=2)
    before = [p.detach().clone() for c in trainable.chunks for p in c.parameters()]
    trainable.zero_grad()
    for chunk in trainable.chunks:
        for p in chunk.parameters():
            p.main_grad.fill_(0.1)
    next(iter(trainable.chunks[0].parameters())).main_grad[0] = float("nan")
    bad = trainable.step()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, (p for c in trainable.chunks for p in c.parameters())))
    trainable.zero_grad()
    for chunk in trainable.chunks:
        for p in chunk.parameters():
            p.main_grad.fill_(0.1)
    good = trainable.step()
    moved = any(not torch.equal(a, p) for a, p in zip(before, (p for c in trainable.chunks for p in c.parameters())))
    return bad.ok, bad.reason, unchanged, good.ok, moved


def test_non_finite_gradients_skip_the_update():
    for bad_ok, reason, unchanged, good_ok, moved in run_distributed(2, nonfinite_step_body):
        assert not bad_ok and "non-finite" in reason and unchanged
        assert good_ok and moved
