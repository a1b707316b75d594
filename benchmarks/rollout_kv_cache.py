"""Generation speed of the rollout decoder with its KV cache vs recomputing the whole prefix.

Without a cache, token ``t`` costs a forward over all ``prompt + t`` tokens, so a response costs
quadratically many token-forwards; with the cache each step is one token per row.  The goal is a
speed-up of at least 5x at 256 new tokens for a small model.

    python benchmarks/rollout_kv_cache.py                       # 4 layers, hidden 256, batch 8
    python benchmarks/rollout_kv_cache.py --device cuda --new-tokens 512
    python benchmarks/rollout_kv_cache.py --threads 1           # on a shared, busy CPU

Both modes decode greedily from the same random weights and left-padded prompts; the script
checks that they produce the same tokens and prints a table:

    mode        new tokens   seconds   tokens/s
    kv-cache          2048      ...        ...
    recompute         2048      ...        ...
    speed-up: ...x
"""

from __future__ import annotations

import argparse
import time

import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.rollout.decoder import left_pad, random_canonical, row_positions
from megatron_rl.rollout.engine import TorchRolloutEngine
from megatron_rl.rollout.sampling import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def recompute_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding that reruns the full left-padded prefix for every new token."""
    device = model.embedding.word_embeddings.weight.device
    ids, mask, _ = left_pad(prompts)
    longest = ids.size(1)
    ids, mask = ids.to(device), mask.to(device)
    ones = torch.ones(len(prompts), 1, dtype=torch.bool, device=device)
    for _ in range(new_tokens):
        positions = row_positions(mask)
        nxt = model(ids, positions, attention_mask=mask, last_only=True)[:, -1].argmax(-1)
        ids, mask = torch.cat([ids, nxt[:, None]], 1), torch.cat([mask, ones], 1)
    return ids[:, longest:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
        num_attention_heads=args.heads, num_query_groups=args.kv_heads, vocab_size=args.vocab,
        params_dtype="float32",
    )
    device = torch.device(args.device)
    engine = TorchRolloutEngine(cfg, device, max_batch_size=args.batch)
    engine.load_weights(random_canonical(cfg, seed=0, std=0.1))
    gen = torch.Generator().manual_seed(0)
    # Prompt lengths from prompt_len/2 to prompt_len, so the batch is really left-padded.
    lengths = torch.linspace(args.prompt_len // 2, args.prompt_len, args.batch).long().tolist()
    prompts = [torch.randint(0, args.vocab, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(greedy=True, max_new_tokens=args.new_tokens)

    engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=4), seed=0)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    cached = engine.generate(prompts, params, seed=0).response_ids
    _sync(device)
    t_cache = time.perf_counter() - t0

    t0 = time.perf_counter()
    recomputed = recompute_greedy(engine.model, prompts, args.new_tokens)
    _sync(device)
    t_recompute = time.perf_counter() - t0

    total = args.batch * args.new_tokens
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch {args.batch}, "
          f"prompts {min(lengths)}-{max(lengths)} tokens, {args.new_tokens} new tokens, {device}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'mode':<12}{'new tokens':>11}{'seconds':>10}{'tokens/s':>11}")
    for name, seconds in (("kv-cache", t_cache), ("recompute", t_recompute)):
        print(f"{name:<12}{total:>11}{seconds:>10.2f}{total / seconds:>11.0f}")
    print(f"speed-up: {t_recompute / t_cache:.1f}x (goal >= 5x); same tokens: {cached == recomputed}")


if __name__ == "__main__":
    main()
