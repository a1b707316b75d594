"""benchmarks/rollout_refit.py: one layout pair on a tiny model, and the table and verdict it prints."""

from __future__ import annotations

from megatron_rl.testing.benchmarks import load_benchmark
from megatron_rl.testing.harness import run_distributed

TINY = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
            vocab_size=64, make_vocab_size_divisible_by=32, params_dtype="float32")


def test_tp2_into_tp1_receives_the_whole_model_half_of_it_from_the_other_rank():
    bench = load_benchmark("rollout_refit")
    ranks = run_distributed(4, bench.measure_pair, TINY, dict(tp=2), dict(tp=1), 1)
    # The vocabulary pads to 64 rows at TP1 and TP2, so a TP1 shard is exactly the canonical model.
    full = ranks[0]["gather_bytes"]
    for r in ranks:
        assert len(r["refit_s"]) == len(r["gather_s"]) == 2
        assert r["shard_bytes"] == full and r["refit_bytes"] == [full, full]
        assert r["train_bytes"] + r["remote_bytes"] == full  # a rank's own TP half is a copy within the rank
    row = bench.summarise(ranks)
    assert row["within_shard"] and row["worst_ratio"] == 1.0 and row["remote_bytes"] < row["refit_bytes"]


def test_table_and_verdict():
    bench = load_benchmark("rollout_refit")
    rank = dict(refit_s=[3.0, 1.0, 2.0, 1.0], gather_s=[5.0, 4.0, 4.0, 6.0], refit_bytes=[4 * 2**20] * 4,
                remote_bytes=2**20, shard_bytes=4 * 2**20, gather_bytes=8 * 2**20)
    slow = dict(rank, refit_s=[3.0, 1.5, 2.0, 1.5])
    row = bench.summarise([rank, slow])  # per call the slower rank, then the median of the calls after the first
    assert (row["refit_first"], row["refit_median"], row["gather_median"]) == (3.0, 1.5, 4.0)
    assert "| tp2 | tp1 | 3.000 | 1.500 | 5.000 | 4.000 | 2.7x | 4.0 | 1.0 | 4.0 | 8.0 | 1.000 | yes |" in (
        bench.format_table([("tp2", "tp1", row)]))
    assert bench.verdict([("tp2", "tp1", row)]).endswith("PASS")
    over = bench.summarise([dict(rank, refit_bytes=[5 * 2**20] * 4)])
    assert not over["within_shard"] and bench.verdict([("tp2", "tp1", row), ("cp2", "tp1", over)]).endswith("FAIL")
