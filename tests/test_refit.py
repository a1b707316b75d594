"""``rollout.layout``: the inference model refit from the training shards is exact.

After :func:`megatron_rl.rollout.refit.refit` every parameter of the inference model equals, bit
for bit, the same model built directly on the inference layout and loaded from the training
model's canonical weights -- for dense training layouts TP2, PP2, PP2 x VPP2, TP2 x PP2, CP2,
TP2 x CP2 into TP1 and TP2 inference layouts, and MoE training layouts EP2 and PP2 x EP2 into TP1
and EP2.  Each rank receives no more bytes than its inference shard holds.
"""

from __future__ import annotations

import pytest

from megatron_rl.testing.harness import run_distributed

DENSE = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
             vocab_size=64, params_dtype="float32")
MOE = dict(DENSE, num_layers=2, moe=dict(num_experts=4, router_topk=2, ffn_hidden_size=16))

TRAINING = {
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "pp2_vpp2": dict(pp=2, vpp=2),
    "tp2_pp2": dict(tp=2, pp=2),
    "cp2": dict(cp=2),
    "tp2_cp2": dict(tp=2, cp=2),
}
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
MOE_TRAINING = {"ep2": dict(ep=2), "pp2_ep2": dict(pp=2, ep=2)}


def refit_body(model_kw: dict, train_kw: dict, infer_kw: dict) -> dict:
    """Refit a random actor on ``train_kw`` into ``infer_kw``; compare with a direct load."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_rl.config.schema import ModelConfig, MoEConfig
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical, load_canonical
    from megatron_rl.rollout.refit import build_inference_model, refit
    from megatron_rl.testing.layouts import use_layout

    model_cfg = ModelConfig(**{**model_kw, "moe": MoEConfig(**model_kw.get("moe", {}))})
    train = use_layout(**train_kw, seed=7)
    chunks = build_gpt_chunks(model_cfg, train, torch.device("cpu"))
    canonical = gather_canonical(chunks)
    infer_layout = ParallelLayout(**infer_kw)
    infer = build_inference_model(model_cfg, infer_layout, train, torch.device("cpu"))
    first = refit(chunks, infer, "gloo")
    with torch.no_grad():  # a second refit after the weights moved: the cached plan, new values
        for chunk in chunks:
            for p in chunk.parameters():
                p.add_(0.25)
    canonical = {k: v + 0.25 for k, v in canonical.items()}
    second = refit(chunks, infer, "gloo")
    got = {name: p.detach().clone() for name, p in infer.named_parameters()}
    shard_bytes = sum(p.numel() * p.element_size() for p in infer.parameters())

    reference_layout = use_layout(tp=infer_layout.tp, pp=infer_layout.pp, ep=infer_layout.ep, etp=infer_layout.etp)
    reference = build_gpt_chunks(model_cfg, reference_layout, torch.device("cpu"), initialize=False)
    load_canonical(reference, canonical)
    want = {name: p.detach() for name, p in reference[0].named_parameters()}
    for name in VOCAB_ROWS:  # padded vocabulary rows are no weights (the two layouts pad differently)
        for tensors in (got, want):
            if name in tensors:
                rows = tensors[name].shape[0]
                row0 = ps.get_tensor_model_parallel_rank() * rows  # this TP rank's first vocabulary row
                tensors[name] = tensors[name][: max(0, min(rows, model_cfg.vocab_size - row0))]
    mismatched = sorted(n for n in want if n not in got or not torch.equal(got[n], want[n]))
    return dict(names=sorted(got) == sorted(want), mismatched=mismatched, bytes=second.bytes_received,
                shard_bytes=shard_bytes, first_bytes=first.bytes_received)


def _check(results):
    for rank, r in enumerate(results):
        assert r["names"], f"rank {rank}: the inference model's parameters are not the reference's"
        assert r["mismatched"] == [], f"rank {rank}: not bit-exact after refit: {r['mismatched'][:5]}"
        assert 0 < r["bytes"] <= r["shard_bytes"], f"rank {rank}: {r['bytes']} bytes for {r['shard_bytes']}"


@pytest.mark.parametrize("infer", [dict(tp=1), dict(tp=2)], ids=["into_tp1", "into_tp2"])
@pytest.mark.parametrize("train", list(TRAINING), ids=list(TRAINING))
def test_refit_from_a_dense_training_layout_is_bit_exact(train, infer):
    _check(run_distributed(4, refit_body, DENSE, TRAINING[train], infer))


@pytest.mark.parametrize("infer", [dict(tp=1), dict(ep=2)], ids=["into_tp1", "into_ep2"])
@pytest.mark.parametrize("train", list(MOE_TRAINING), ids=list(MOE_TRAINING))
def test_refit_from_a_moe_training_layout_is_bit_exact(train, infer):
    _check(run_distributed(4, refit_body, MOE, MOE_TRAINING[train], infer))
