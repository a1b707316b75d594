"""benchmarks/rollout_static_batch.py: its static-batching loops over megatron's inference API (with
the shortest prompt's prefill, and left-padded under an attention mask) give the dynamic engine's
samples, and every way it times runs."""

from __future__ import annotations

from megatron_rl.testing.benchmarks import load_benchmark
from megatron_rl.testing.harness import run_distributed


def test_static_batching_gives_the_dynamic_engines_samples_and_each_way_is_timed():
    bench = load_benchmark("rollout_static_batch")
    result = run_distributed(1, bench.measure, 1)[0]
    checks = result["checks"]
    for way in ("static", "padded"):
        for name in ("greedy", "sampled"):
            same, logprob_gap = checks[f"{way} {name}"]
            assert same, (way, name)
            assert logprob_gap < 1e-5, (way, name, logprob_gap)
    # prompts of 4-6 tokens, 4 new tokens: the shortest prompt's prefill then one position a step,
    # or (left-padded) one prefill and a step per further new token
    assert checks["static steps"] == 6 and checks["padded steps"] == 4
    assert {name: len(t) for name, t in result["times"].items()} == {"decoder": 1, "dynamic": 1, "static": 1,
                                                                      "padded": 1}
    assert all(t > 0 for times in result["times"].values() for t in times)
