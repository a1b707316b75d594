"""megatron's engine on the CPU, static batching against its dynamic engine and the former KV-cache
decoder, on ``benchmarks/vs_trl.py``'s rollout shape.

    python benchmarks/rollout_static_batch.py [--rounds 15]

The CPU default generator is megatron-core's static-batching inference (``rollout.batching=static``,
:mod:`megatron_rl.rollout.static_batching`); until it was, the CPU default was a hand-written
KV-cache decoder, now the test oracle ``tests/support/decoder.py``.  This script measures what that
change costs a rollout.  The shape is vs_trl's: 16 prompts of 4-6 tokens x 8 samples, 4 new tokens
at temperature 1, the TRL workload's model (2 layers, hidden 64, 4 heads / 2 KV heads, a 20-token
vocabulary), one thread.  Each way is timed as the trainer pays for it (the weights loaded, one
rollout, the weights released), rounds interleaved; the figure is CPU milliseconds per rollout
(median and fastest):

* ``decoder``   -- the former ``rollout.engine=torch``: a full canonical copy gathered from the
  actor's shards, then the decoder's left-padded prefill and one token a step;
* ``dynamic``   -- ``rollout.batching=dynamic``: megatron's ``DynamicInferenceEngine`` on the
  actor's shards (paged KV cache, continuous batching) through the CPU stand-ins for its kernels;
* ``static``    -- ``rollout.batching=static`` (the default here): each distinct prompt prefilled
  once, its KV rows copied to its samples, then one position a step;
* ``unshared``  -- the same with ``rollout.prefix_caching=false``: every sample prefills its prompt.

It also checks that static batching gives the dynamic engine's samples (greedy and sampled, the
same keys) and prints the prompt tokens each way prefilled.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# benchmarks/trl_workload.py's model and vocabulary (a character tokenizer of 20 ids)
MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             vocab_size=20, params_dtype="float32", transformer_impl="local", max_position_embeddings=1024)
PROMPTS, SAMPLES, NEW_TOKENS = 16, 8, 4


def measure(rounds: int) -> dict:
    """In a one-rank worker: build the model once, then time every way, interleaved."""
    if REPO not in sys.path:  # the decoder is a test oracle, under tests/
        sys.path.insert(0, REPO)
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import load_canonical
    from megatron_rl.rollout.megatron import MegatronRolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.testing.weights import random_canonical
    from tests.support.decoder import TorchRolloutEngine

    torch.set_num_threads(1)
    cfg = ModelConfig(**MODEL)
    chunks = build_gpt_chunks(cfg, use_layout(), torch.device("cpu"))
    load_canonical(chunks, random_canonical(cfg, 0, std=0.2))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size - 1, (int(torch.randint(4, 7, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(PROMPTS)]
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, n=SAMPLES)
    greedy = SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS, n=1)
    engine_kw = dict(max_batch_size=PROMPTS * SAMPLES, kv_cache_memory=float(2**26), prefill_chunk_tokens=4096,
                     kv_block_tokens=256)
    engines = {
        "decoder": TorchRolloutEngine(cfg, "cpu", max_batch_size=PROMPTS * SAMPLES),
        "dynamic": MegatronRolloutEngine(cfg, "cpu", batching="dynamic", **engine_kw),
        "static": MegatronRolloutEngine(cfg, "cpu", batching="static", **engine_kw),
        "unshared": MegatronRolloutEngine(cfg, "cpu", batching="static", prefix_caching=False, **engine_kw),
    }

    def run(name: str, seed: int, p=params):
        engine = engines[name]
        engine.load_from_chunks(chunks)
        batch = engine.generate(prompts, p, seed=seed)
        engine.release_weights()
        return batch

    checks = {}
    for label, p, seed in (("greedy", greedy, 0), ("sampled", params, 3)):
        static, dynamic = run("static", seed, p), run("dynamic", seed, p)
        checks[label] = (static.response_ids == dynamic.response_ids, max(
            abs(a - b) for x, y in zip(static.response_logprobs, dynamic.response_logprobs) for a, b in zip(x, y)))
    prefill = {}
    for name in ("dynamic", "static", "unshared"):
        run(name, 0)
        prefill[name] = engines[name].prefill_tokens
    for name in engines:  # warm-up
        run(name, 0)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        for name in engines:
            c0 = time.process_time()
            run(name, r + 1)
            times[name].append(time.process_time() - c0)
    return {"times": times, "checks": checks, "prefill": prefill, "prompt_tokens": sum(map(len, prompts)) * SAMPLES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    from megatron_rl.testing.harness import get_pool, importable_script

    module = importable_script(__file__, __spec__)
    result = get_pool(1).run(module.measure, args.rounds, timeout=1800)[0]
    checks = result["checks"]
    print(f"{PROMPTS} prompts of 4-6 tokens x {SAMPLES} samples, {NEW_TOKENS} new tokens, temperature 1; "
          f"2 layers, hidden 64, vocab 20; one thread; {args.rounds} interleaved rounds")
    for label in ("greedy", "sampled"):
        same, gap = checks[label]
        print(f"static == dynamic engine, {label}: tokens {same} (log-probs within {gap:.1e})")
    print("prompt tokens prefilled of " + str(result["prompt_tokens"]) + ": "
          + ", ".join(f"{name} {count}" for name, count in result["prefill"].items()))
    print("| way | CPU ms per rollout, median | fastest | vs decoder (median) |")
    print("|---|---|---|---|")
    base = sorted(result["times"]["decoder"])[len(result["times"]["decoder"]) // 2]
    for name, values in result["times"].items():
        values = sorted(values)
        median = values[len(values) // 2]
        print(f"| {name} | {median * 1e3:.1f} | {values[0] * 1e3:.1f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
