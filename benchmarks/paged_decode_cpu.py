"""One decode step of attention over megatron's paged KV cache on the CPU: the stand-in for
flash-attn's paged kernel (``compat/inference_cpu.py:sdpa_decode_paged``) against SDPA over a
contiguous cache padded to the longest request (what the torch decoder's static batches do).

The stand-in copies each request's KV pages into a dense tensor every layer and step, grouped by
length (``decode_groups``) so that one long request does not make the short ones attend over its
length.  Two mixes of 16 requests: similar lengths (100-250 tokens) and a long tail (one request
of 600 tokens among 60-140).  Pages of 16 tokens, scattered over the cache in random order;
8 query heads over 4 KV heads of 32; fp32; one thread; CPU time per call, the best of 5 x 40.

    python benchmarks/paged_decode_cpu.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from megatron_rl.compat.inference_cpu import sdpa_decode_paged

MIXES = {"similar": (100, 250, None), "long tail": (60, 140, 600)}


def paged_batch(lengths: torch.Tensor, block: int, kv_heads: int, dim: int, gen: torch.Generator):
    """A cache with each request's pages at random places, its block table, and the same keys and
    values laid out contiguously per request (padded to the longest)."""
    pages = [(int(n) + block - 1) // block for n in lengths]
    total = sum(pages) + 8
    k_cache = torch.randn(total, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(total, block, kv_heads, dim, generator=gen)
    table = torch.full((len(pages), max(pages)), -1, dtype=torch.int32)
    order, used = torch.randperm(total, generator=gen), 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used:used + n].int()
        used += n
    longest = int(lengths.max())
    dense_k = torch.zeros(len(pages), longest, kv_heads, dim)
    dense_v = torch.zeros_like(dense_k)
    for i, n in enumerate(lengths.tolist()):
        dense_k[i, :n] = k_cache[table[i, : pages[i]].long()].flatten(0, 1)[:n]
        dense_v[i, :n] = v_cache[table[i, : pages[i]].long()].flatten(0, 1)[:n]
    return k_cache, v_cache, table, dense_k, dense_v


def dense_decode(q, keys, values, lengths):
    """SDPA over a contiguous cache padded to the longest request, masked per row."""
    mask = torch.arange(keys.size(1))[None, :] < lengths[:, None].long()
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], enable_gqa=q.size(2) != keys.size(2))
    return out.transpose(1, 2)


def cpu_ms(fn, calls: int = 40, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - start) / calls * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 8, 4, 32
    print("| lengths | paged stand-in, CPU-ms | dense SDPA (padded cache), CPU-ms | stand-in / dense | max abs diff |")
    print("|---|---|---|---|---|")
    for name, (low, high, long_one) in MIXES.items():
        lengths = torch.randint(low, high + 1, (args.requests,), generator=gen).int()
        if long_one:
            lengths[0] = long_one
        k_cache, v_cache, table, dense_k, dense_v = paged_batch(lengths, args.block, kv_heads, dim, gen)
        q = torch.randn(args.requests, 1, heads, dim, generator=gen)
        paged = sdpa_decode_paged(q, k_cache, v_cache, lengths, table)
        diff = (paged - dense_decode(q, dense_k, dense_v, lengths)).abs().max().item()
        ms_paged = cpu_ms(lambda: sdpa_decode_paged(q, k_cache, v_cache, lengths, table))
        ms_dense = cpu_ms(lambda: dense_decode(q, dense_k, dense_v, lengths))
        span = f"{low}-{high}" + (f" + one of {long_one}" if long_one else "")
        print(f"| {name}: {span} | {ms_paged:.2f} | {ms_dense:.2f} | {ms_paged / ms_dense:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
