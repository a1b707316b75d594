"""benchmarks/async_throughput.py: the interleaved order, the per-round ratios and the verdicts,
and the long-tail workload it runs (long responses graded as their answer)."""

from __future__ import annotations

import subprocess
import sys

from megatron_rl.testing.benchmarks import load_benchmark


def _row(bench, mode, rnd, samples_per_s, regime="floor", seed=None, reward=0.2, idle=0.1):
    sync = mode == "sync"
    return dict(mode=mode, seed=seed or bench.FIRST_SEED, regime=regime, round=rnd, samples_per_s=samples_per_s,
                tokens_per_s=1.0, trainer_idle=None if sync else idle, generator_idle=None if sync else idle,
                staleness_max=0 if sync else 1, token_staleness=0.0, reward_last=reward, reward_final=reward,
                length_mean=5.0, stopped_frac=0.9)


def test_rounds_rotate_the_order_and_each_ratio_is_against_its_own_rounds_sync():
    bench = load_benchmark("async_throughput")
    order = bench.interleaved([("sync", 1), ("one_step_off", 1), ("async", 1)], 3)
    assert [(r, m) for r, m, _ in order] == [
        (0, "sync"), (0, "one_step_off"), (0, "async"), (1, "one_step_off"), (1, "async"), (1, "sync"),
        (2, "async"), (2, "sync"), (2, "one_step_off")]
    # Round 1 ran on a machine twice as slow: its ratios are still those of its own round.
    rows = [_row(bench, "sync", 0, 10.0), _row(bench, "async", 0, 17.0), _row(bench, "one_step_off", 0, 12.0),
            _row(bench, "sync", 1, 5.0), _row(bench, "async", 1, 8.0), _row(bench, "one_step_off", 1, 6.5)]
    summary = {r["mode"]: r for r in bench.summarise(rows, "floor")}
    assert summary["async"]["ratios"] == [1.7, 1.6] and abs(summary["async"]["vs_sync"] - 1.65) < 1e-12
    assert summary["one_step_off"]["ratios"] == [1.2, 1.3] and abs(summary["one_step_off"]["vs_sync"] - 1.25) < 1e-12
    lines = bench.target_lines({"floor": list(summary.values())})
    assert "PASS  floor: async 1.65x sync (>= 1.5x)" in lines
    assert "PASS  floor: one_step_off 1.25x sync (>= 1.25x)" in lines
    assert "PASS  floor: async idle trainer 10% / generator 10% (each <= 15%)" in lines


def test_cpu_verdicts_name_a_slow_mode_and_a_reward_below_the_sync_seeds():
    bench = load_benchmark("async_throughput")
    rows = [_row(bench, "sync", 0, 10.0, "cpu", reward=0.20), _row(bench, "sync", 0, 10.0, "cpu", 1235, 0.25),
            _row(bench, "sync", 0, 10.0, "cpu", 1236, 0.30), _row(bench, "async", 0, 8.5, "cpu", reward=0.10, idle=0.3),
            _row(bench, "one_step_off", 0, 9.5, "cpu", reward=0.22)]
    lines = bench.target_lines({"cpu": bench.summarise(rows, "cpu")})
    assert "FAIL  cpu: async 0.85x sync (no more than 10% slower)" in lines
    assert "PASS  cpu: one_step_off 0.95x sync (no more than 10% slower)" in lines
    assert "FAIL  cpu: async idle trainer 30% / generator 30% (each <= 15%)" in lines
    spread = ("FAIL  cpu: async reward 0.100 (last 10 steps, mean of 1 seed(s): 0.100) within the sync seeds' "
              "spread 0.200-0.300")
    assert any(line.startswith(spread) for line in lines), lines
    assert any(line.startswith("PASS  cpu: one_step_off reward 0.220") for line in lines)


def test_a_stale_modes_reward_is_the_mean_of_its_seeds():
    """One unlucky seed does not decide: async's seeds 0.10 / 0.26 / 0.34 average 0.233, inside
    sync's 0.20-0.30; one_step_off's 0.15 / 0.19 / 0.20 average 0.180, below it."""
    bench = load_benchmark("async_throughput")
    rows = [_row(bench, "sync", 0, 10.0, "cpu", 1234 + k, reward) for k, reward in enumerate((0.20, 0.25, 0.30))]
    rows += [_row(bench, "async", 0, 12.0, "cpu", 1234 + k, reward) for k, reward in enumerate((0.10, 0.26, 0.34))]
    rows += [_row(bench, "one_step_off", 0, 12.0, "cpu", 1234 + k, reward)
             for k, reward in enumerate((0.15, 0.19, 0.20))]
    lines = bench.target_lines({"cpu": bench.summarise(rows, "cpu")})
    # Speed and idle read the first seed only: one line each, not one per seed.
    assert sum(line.startswith(("PASS  cpu: async 1.20x", "FAIL  cpu: async 1.20x")) for line in lines) == 1, lines
    assert sum("cpu: async idle" in line for line in lines) == 1, lines
    assert any(line.startswith("PASS  cpu: async reward 0.233 (last 10 steps, mean of 3 seed(s): 0.100 / 0.260 / "
                               "0.340) within the sync seeds' spread 0.200-0.300") for line in lines), lines
    assert any(line.startswith("FAIL  cpu: one_step_off reward 0.180") for line in lines), lines


def test_the_long_tail_costs_length_not_reward():
    """A long-tail response runs past its EOS; what the reward reads ends there, so the answer it
    gave is graded as it would have been had it stopped."""
    code = (
        "from megatron_rl.testing.workload import install_long_tail\n"
        "from megatron_rl.data.tokenizer import CharTokenizer\n"
        "from megatron_rl.trainer import ppo\n"
        "from megatron_rl.rollout import engine\n"
        "from megatron_rl.rollout.sampling import SamplingParams\n"
        "tok = CharTokenizer()\n"
        "answer = tok.encode('27') + [tok.eos_id]\n"
        "before = ppo._Decoded(tok, [answer + tok.encode('99x')])[0]\n"
        "install_long_tail()\n"
        "after = ppo._Decoded(tok, [answer + tok.encode('99x'), tok.encode('31')])\n"
        "params = SamplingParams(max_new_tokens=8, stop_token_ids=(tok.eos_id,))\n"
        "tail = [i for i in range(4, 60) if i % 5 == 2][0]\n"
        "print(before, after[0], after[1], engine.stopped([tail, tok.eos_id], params),"
        " engine.stopped([tail + 1, tok.eos_id], params))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["2799x", "27", "31", "False", "True"]


def test_staleness_shares_count_each_steps_samples_at_their_staleness():
    bench = load_benchmark("async_throughput")
    rows = [{"rollout/staleness_p50": 0, "rollout/staleness_max": 0}, {"rollout/staleness_p50": 1},
            {"rollout/staleness_p50": 2}, {"rollout/staleness_p50": 2, "rollout/staleness_max": 2}]
    assert bench.staleness_shares(rows) == {0: 0.25, 1: 0.25, 2: 0.5}
