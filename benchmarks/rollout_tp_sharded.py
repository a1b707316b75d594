"""Per-rank memory of generation: a full copy of the actor on every rank vs the TP-sharded engine.

``rollout.engine=torch`` gathers the actor's full weights onto every rank; ``tp_sharded`` keeps
megatron's TP shard.  For each TP size this builds the megatron actor on TP gloo ranks (CPU; one
process per rank), loads both engines from it, decodes the same prompts greedily with each, and
reports per rank: the generation weights, the KV cache of the batch, the weight-sync time (gather
vs shard copy) and the decode time.  The script checks that both engines produce the same tokens.

    python benchmarks/rollout_tp_sharded.py                  # TP 1, 2, 4; 4 layers, hidden 512
    python benchmarks/rollout_tp_sharded.py --tp 2 --new-tokens 128

Expected: weights and KV cache per rank at TP=k are about 1/k of the full copy.  On a CPU with
fewer cores than ranks the decode times say little (the ranks share cores); on GPUs TP also
divides the per-token work.
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_rl.config.schema import ModelConfig

MiB = 2**20


def measure_rank(cfg: ModelConfig, tp: int, prompts: list[list[int]], new_tokens: int) -> dict:
    """On one TP rank: both engines loaded from the same megatron actor; sizes, times, tokens."""
    import torch.distributed as dist

    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical, load_canonical
    from megatron_rl.planner.memory import kv_cache_bytes
    from megatron_rl.rollout.decoder import random_canonical
    from megatron_rl.rollout.engine import make_engine
    from megatron_rl.rollout.sampling import SamplingParams
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(tp=tp)
    chunks = build_gpt_chunks(cfg, layout, torch.device("cpu"))
    load_canonical(chunks, random_canonical(cfg, seed=0, std=0.05))
    params = SamplingParams(greedy=True, max_new_tokens=new_tokens)
    out = {}
    for name in ("torch", "tp_sharded"):
        engine = make_engine(name, cfg, "cpu", max_batch_size=len(prompts))
        dist.barrier()
        t0 = time.perf_counter()
        if name == "torch":
            engine.load_weights(gather_canonical(chunks))
        else:
            engine.load_from_chunks(chunks)
        sync = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        tokens = engine.generate(prompts, params, seed=0).response_ids
        decode = time.perf_counter() - t0
        longest = max(map(len, prompts)) + new_tokens
        shards = engine.model.tp.size  # the sharded engine's cache holds this rank's KV heads only
        kv = kv_cache_bytes(cfg, len(prompts), longest, engine.model.output_weight().element_size()) / shards
        out[name] = dict(weights=engine.weight_bytes(), kv=kv, sync=sync, decode=decode, tokens=tokens)
        engine.release_weights()
    return out


def main() -> None:
    from megatron_rl.testing.harness import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
                      num_attention_heads=args.heads, num_query_groups=args.kv_heads, vocab_size=args.vocab,
                      params_dtype="float32", make_vocab_size_divisible_by=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} KV, vocab "
          f"{args.vocab}, fp32; batch {args.batch} x ({args.prompt_len} + {args.new_tokens}) tokens, greedy")
    print(f"{'tp':>3} {'engine':<11}{'weights MiB':>12}{'KV MiB':>8}{'vs full':>9}{'sync s':>8}{'decode s':>9}"
          f"  same tokens")
    for tp in args.tp:
        ranks = run_distributed(tp, measure_rank, cfg, tp, prompts, args.new_tokens)
        worst = {name: {k: max(r[name][k] for r in ranks) for k in ("weights", "kv", "sync", "decode")}
                 for name in ("torch", "tp_sharded")}
        same = all(r["tp_sharded"]["tokens"] == ranks[0]["torch"]["tokens"] for r in ranks)
        full = worst["torch"]["weights"] + worst["torch"]["kv"]
        for name, w in worst.items():
            print(f"{tp:>3} {name:<11}{w['weights'] / MiB:>12.1f}{w['kv'] / MiB:>8.1f}"
                  f"{(w['weights'] + w['kv']) / full:>8.3f}x{w['sync']:>8.2f}{w['decode']:>9.2f}  {same}")


if __name__ == "__main__":
    main()
