"""Refit cost: ``rollout.layout``'s resharding refit against today's full gather, per layout pair.

Before every rollout the inference model must hold the actor's current weights.  Until
``rollout.layout`` the engines got them with ``gather_canonical``: the full model gathered onto
every rank.  :func:`megatron_rl.rollout.refit.refit` instead moves, with megatron-core's
``swap_model_weights``, only the slices of each rank's inference shard.  For each (training
layout, inference layout) pair this builds a random actor on 4 gloo ranks (CPU, one process per
rank) and the inference model beside it, then times, interleaved, refit and gather repeats:

* refit: the first call (it builds and caches the plan, collectively) and the median of the rest;
  the bytes each rank receives into its inference shard (max over ranks) against that shard's
  bytes (max over ranks);
* gather: ``gather_canonical`` of the training chunks, first call and median of the rest; every
  rank ends up with the full model, so its bytes per rank are the full model's.

A time is the slowest rank's, each call started after a barrier.  Target: refit moves no more
bytes per rank than the inference shard it fills (every rank, every pair).

    python benchmarks/rollout_refit.py                  # all pairs; 8 layers, hidden 512, vocab 32000, fp32
    python benchmarks/rollout_refit.py --pairs tp2:tp1 ep2:ep2 --repeats 3

On a CPU with fewer cores than ranks the times say little about a GPU cluster (4 ranks share the
cores, gloo copies through shared memory); the bytes are what the layouts make them on any device.
"""

from __future__ import annotations

import argparse
import statistics
import time

MiB = 2**20
WORLD = 4

# Training layouts (keyword arguments of ``use_layout``) and inference layouts (of ``ParallelLayout``).
TRAINING = {
    "tp2": dict(tp=2), "pp2": dict(pp=2), "pp2_vpp2": dict(pp=2, vpp=2), "tp2_pp2": dict(tp=2, pp=2),
    "cp2": dict(cp=2), "tp2_cp2": dict(tp=2, cp=2), "ep2": dict(ep=2), "pp2_ep2": dict(pp=2, ep=2),
}
INFERENCE = {"tp1": dict(tp=1), "tp2": dict(tp=2), "ep2": dict(ep=2)}
DENSE_PAIRS = [(t, i) for t in ("tp2", "pp2", "pp2_vpp2", "tp2_pp2", "cp2", "tp2_cp2") for i in ("tp1", "tp2")]
MOE_PAIRS = [(t, i) for t in ("ep2", "pp2_ep2") for i in ("tp1", "ep2")]
MOE_TRAINING = {"ep2", "pp2_ep2"}


def model_kwargs(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int, experts: int,
                 expert_ffn: int) -> tuple[dict, dict]:
    """The dense model's and the MoE model's ``ModelConfig`` keywords."""
    dense = dict(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                 num_query_groups=kv_heads, vocab_size=vocab, params_dtype="float32")
    return dense, dict(dense, moe=dict(num_experts=experts, router_topk=2, ffn_hidden_size=expert_ffn))


def measure_pair(model_kw: dict, train_kw: dict, infer_kw: dict, repeats: int) -> dict:
    """On one rank: refit and gather, interleaved, ``1 + repeats`` times each; times and bytes."""
    import torch
    import torch.distributed as dist
    from megatron.core.resharding.refit import clear_plan_cache

    from megatron_rl.config.schema import ModelConfig, MoEConfig
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.rollout import refit as refit_mod
    from megatron_rl.testing.layouts import use_layout

    model_cfg = ModelConfig(**{**model_kw, "moe": MoEConfig(**model_kw.get("moe", {}))})
    train = use_layout(**train_kw, seed=7)
    chunks = build_gpt_chunks(model_cfg, train, torch.device("cpu"))
    infer = refit_mod.build_inference_model(model_cfg, ParallelLayout(**infer_kw), train,
                                            torch.device("cpu"))
    out = dict(refit_s=[], gather_s=[], refit_bytes=[],
               shard_bytes=sum(p.numel() * p.element_size() for p in infer.parameters()),
               train_bytes=sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()))
    try:
        for _ in range(1 + repeats):
            dist.barrier()
            stats = refit_mod.refit(chunks, infer, "gloo")
            out["refit_s"].append(stats.seconds)
            out["refit_bytes"].append(stats.bytes_received)
            out["remote_bytes"] = from_other_ranks(chunks, infer)
            dist.barrier()
            start = time.perf_counter()
            full = gather_canonical(chunks)
            out["gather_s"].append(time.perf_counter() - start)
            out["gather_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
            del full
    finally:  # the next pair's models are others: drop the plan and the models it names
        refit_mod._PLANNED.clear()
        clear_plan_cache()
    return out


def from_other_ranks(chunks: list, infer) -> int:
    """Of the bytes the cached plan writes into this rank's inference shard, those another rank
    sends (the rest are copies within the rank: what this rank trains on already)."""
    import torch.distributed as dist
    from megatron.core.resharding.refit import _build_plan_cache_key, _plan_cache, _unwrap_model_cores
    from megatron.core.resharding.utils import get_refit_tensor_dict

    from megatron_rl.models.canonical import unwrap
    from megatron_rl.rollout.refit import _refit_view

    src, tgt, experts = _unwrap_model_cores([_refit_view([unwrap(c) for c in chunks])], [_refit_view([infer])])
    plan = _plan_cache[_build_plan_cache_key(src, tgt, experts)]
    tensors, me = get_refit_tensor_dict(tgt), dist.get_rank()
    return sum(tensors[op.param_name][op.my_slice].numel() * tensors[op.param_name].element_size()
               for op in plan.recv_ops if op.peer_rank != me)


def summarise(ranks: list[dict]) -> dict:
    """One pair's row: per call the slowest rank's time; bytes as the largest rank's."""
    refit_s = [max(r["refit_s"][i] for r in ranks) for i in range(len(ranks[0]["refit_s"]))]
    gather_s = [max(r["gather_s"][i] for r in ranks) for i in range(len(ranks[0]["gather_s"]))]
    return dict(
        refit_first=refit_s[0], refit_median=statistics.median(refit_s[1:]),
        gather_first=gather_s[0], gather_median=statistics.median(gather_s[1:]),
        refit_bytes=max(max(r["refit_bytes"]) for r in ranks),
        remote_bytes=max(r["remote_bytes"] for r in ranks),
        shard_bytes=max(r["shard_bytes"] for r in ranks),
        gather_bytes=max(r["gather_bytes"] for r in ranks),
        # The target holds per rank and per call: what a rank receives fits the shard it fills.
        within_shard=all(0 < b <= r["shard_bytes"] for r in ranks for b in r["refit_bytes"]),
        worst_ratio=max(b / r["shard_bytes"] for r in ranks for b in r["refit_bytes"]),
    )


def format_table(rows: list[tuple[str, str, dict]]) -> str:
    lines = [
        "| training | inference | refit first s | refit median s | gather first s | gather median s | "
        "gather / refit | refit MiB/rank | of it from other ranks | shard MiB/rank | gather MiB/rank | "
        "refit / shard | within shard |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for train, infer, s in rows:
        lines.append(
            f"| {train} | {infer} | {s['refit_first']:.3f} | {s['refit_median']:.3f} | {s['gather_first']:.3f} | "
            f"{s['gather_median']:.3f} | {s['gather_median'] / s['refit_median']:.1f}x | "
            f"{s['refit_bytes'] / MiB:.1f} | {s['remote_bytes'] / MiB:.1f} | {s['shard_bytes'] / MiB:.1f} | "
            f"{s['gather_bytes'] / MiB:.1f} | "
            f"{s['worst_ratio']:.3f} | {'yes' if s['within_shard'] else 'NO'} |")
    return "\n".join(lines)


def verdict(rows: list[tuple[str, str, dict]]) -> str:
    ok = all(s["within_shard"] for _, _, s in rows)
    worst = max(s["worst_ratio"] for _, _, s in rows)
    return (f"target: refit moves no more bytes per rank than the inference shard it fills "
            f"(worst rank: {worst:.3f}x its shard, {len(rows)} pairs): {'PASS' if ok else 'FAIL'}")


def _this_module():
    """This file as an importable module, so harness workers can unpickle its functions."""
    from megatron_rl.testing.harness import importable_script

    return importable_script(__file__, __spec__)


def main(argv=None) -> int:
    from megatron_rl.testing.harness import run_distributed

    all_pairs = [f"{t}:{i}" for t, i in DENSE_PAIRS + MOE_PAIRS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=all_pairs, help="training:inference, e.g. tp2:tp1 ep2:ep2")
    parser.add_argument("--repeats", type=int, default=3, help="calls of each after the first")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--experts", type=int, default=4, help="routed experts of the MoE model")
    parser.add_argument("--expert-ffn", type=int, default=704)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1 (the first call builds the plan)")

    dense, moe = model_kwargs(args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab,
                              args.experts, args.expert_ffn)
    me = _this_module()
    print(f"dense: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, {args.heads} heads / {args.kv_heads} "
          f"KV, vocab {args.vocab}, fp32; MoE: the same with {args.experts} experts of ffn {args.expert_ffn}, top-2; "
          f"{WORLD} gloo ranks, {args.repeats} timed repeats after the first")
    rows = []
    for pair in args.pairs:
        train, infer = pair.split(":")
        kw = moe if train in MOE_TRAINING else dense
        start = time.perf_counter()
        ranks = run_distributed(WORLD, me.measure_pair, kw, TRAINING[train], INFERENCE[infer], args.repeats)
        rows.append((train, infer, summarise(ranks)))
        print(f"  {train} -> {infer}: done in {time.perf_counter() - start:.0f}s", flush=True)
    print(format_table(rows))
    print(verdict(rows))
    return 0 if all(s["within_shard"] for _, _, s in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
