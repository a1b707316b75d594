"""Packed causal attention at CP=1: bucketed fused calls vs one call per sequence vs padded rows.

    python benchmarks/packed_attention.py [--sequences 128] [--min-len 12] [--max-len 20] [--repeats 5]

An RL micro-batch holds many short sequences of mixed lengths.  ``batch.packing=true`` packs
them into one THD row; attention must not cross sequences.  This times attention forward +
backward (fp32, 4 query heads over 2 KV heads, head dim 32) three ways on the same tokens:

* ``packed (megatron_rl)``: :func:`megatron_rl.ops.packed_attention.packed_causal_attention`;
* ``one SDPA call per sequence``: what the packed path did before;
* ``padded rows``: ``batch.packing=false``, every sequence right-padded to the longest (the
  reference a user would otherwise pick), on its own padded tensors.

Prints the best of ``--repeats`` for each, and the ratio packed / padded.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

from megatron_rl.ops.packed_attention import packed_causal_attention


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--min-len", type=int, default=12)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len, (args.sequences,), generator=g).tolist()
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    heads, kv_heads, dim = 4, 2, 32
    leaves = [torch.randn(1, n, cu[-1], dim, generator=g, requires_grad=True) for n in (heads, kv_heads, kv_heads)]
    longest = max(lengths)
    padded = [torch.randn(args.sequences, n, longest, dim, generator=g, requires_grad=True)
              for n in (heads, kv_heads, kv_heads)]
    q, k, v = leaves

    def packed():
        packed_causal_attention(q, k, v, tuple(cu), dim**-0.5).sum().backward()

    def per_sequence():
        outs = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True,
                                               enable_gqa=True) for s, e in zip(cu[:-1], cu[1:])]
        torch.cat(outs, 2).sum().backward()

    def padded_rows():
        F.scaled_dot_product_attention(*padded, is_causal=True, enable_gqa=True).sum().backward()

    runs = {"packed (megatron_rl)": packed, "one SDPA call per sequence": per_sequence, "padded rows": padded_rows}
    best = {name: float("inf") for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{args.sequences} sequences of {args.min_len}-{args.max_len - 1} tokens, attention fwd+bwd, fp32, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    print("| path | ms |\n|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.1f} |")
    print(f"packed / padded rows: {best['packed (megatron_rl)'] / best['padded rows']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
