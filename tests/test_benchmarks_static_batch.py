"""benchmarks/rollout_static_batch.py: the engine's static batching gives the dynamic engine's samples
and prefills a group's prompt once, and every way it times runs."""

from __future__ import annotations

from megatron_rl.testing.benchmarks import load_benchmark
from megatron_rl.testing.harness import run_distributed


def test_static_batching_gives_the_dynamic_engines_samples_and_each_way_is_timed():
    bench = load_benchmark("rollout_static_batch")
    result = run_distributed(1, bench.measure, 1)[0]
    for name in ("greedy", "sampled"):
        same, logprob_gap = result["checks"][name]
        assert same, name
        assert logprob_gap < 1e-4, (name, logprob_gap)
    prompt_tokens = result["prompt_tokens"]  # 8 samples of each prompt
    assert result["prefill"]["static"] * bench.SAMPLES == prompt_tokens == result["prefill"]["unshared"]
    assert {name: len(t) for name, t in result["times"].items()} == {"decoder": 1, "dynamic": 1, "static": 1,
                                                                      "unshared": 1}
    assert all(t > 0 for times in result["times"].values() for t in times)
