"""Trained samples per second of ``sync`` on 2 colocated ranks against ``one_step_off`` and
``async`` (with and without partial rollouts) on 1 generator rank and 1 training rank
(``rollout.ranks=1``), same model, prompts, samples and steps.

    python benchmarks/async_throughput.py                      # both regimes, about 10 min on 2 cores
    python benchmarks/async_throughput.py --regimes floor --steps 12

The workload is ``configs/grpo_cpu.yaml`` (the add_small task after its supervised warm-up, GRPO,
16 prompts x 8 samples a step) with ``rollout.max_new_tokens=32`` and a long tail
(:mod:`megatron_rl.testing.workload`, applied in every process of the job): every response whose
first token id is 2 mod 5 (about a tenth: two of the ten digits the answers start with) ignores
EOS and runs to 32 tokens, while the rest stop after the answer (2-3 tokens); the mean length
and the share that stopped are printed per mode.

Two cost regimes, each mode a subprocess of its own:

* ``cpu``   -- this CPU as it is: a decode step's cost grows with its rows, so rows that finished
  early cost nothing and the long tail wastes little;
* ``floor`` -- an emulation of a memory-bound GPU decode: the same module gives every decode step
  of the KV-cache decoder a floor of ``--floor-ms`` whatever its rows (prefill and training
  untouched), so a batch costs its longest response, as on a GPU.

Per mode: trained samples/s and generated tokens/s over the sum of the trainer's ``timing/step_s``
(rollout or the wait for it, reward, experience, update and weight push; not start-up, warm-up or
the final checkpoint), each side's idle fraction (the trainer's wait for batches, the generators'
wait for requests), the reward of the last 5 steps.  ``sync`` runs ``--seeds`` seeds in the cpu
regime to show the spread of the reward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from megatron_rl.testing.workload import job_env  # noqa: E402  (the repo, also when not installed)

SAMPLES_PER_STEP = 16 * 8  # configs/grpo_cpu.yaml: trainer.prompts_per_step x rollout.n
MODES = {
    "sync": ["--nproc", "2"],
    "one_step_off": ["--nproc", "2", "rollout.ranks=1", "trainer.mode=one_step_off"],
    "async": ["--nproc", "2", "rollout.ranks=1", "trainer.mode=async", "trainer.max_staleness=2"],
    "async_partial": ["--nproc", "2", "rollout.ranks=1", "trainer.mode=async", "trainer.max_staleness=2",
                      "trainer.partial_rollouts=true"],
}

def run_mode(mode: str, regime: str, seed: int, steps: int, floor_s: float, work: str) -> dict:
    name = f"{mode}_{regime}_{seed}"
    env = job_env(long_tail=True, decode_floor_s=floor_s if regime == "floor" else 0.0)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], REPO])
    env.pop("MEGATRON_RL_FAULT", None)
    cmd = [sys.executable, "-m", "megatron_rl.tools.cli", "train", "--config",
           os.path.join(REPO, "configs", "grpo_cpu.yaml"), *MODES[mode], "rollout.max_new_tokens=32",
           f"trainer.steps={steps}", f"run.seed={seed}", f"run.dir={work}", f"run.name={name}", "trainer.plot=false"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(work, name, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if '"step"' in line]
    rows = [r for r in rows if r.get("step", 0) >= 1 and "timing/step_s" in r]
    wall = sum(r["timing/step_s"] for r in rows)
    samples = SAMPLES_PER_STEP * len(rows)
    tokens = sum(r["throughput/generated_tokens_per_s"] * r["timing/step_s"] for r in rows)
    after_first = rows[1:] or rows
    late_wall = sum(r["timing/step_s"] for r in after_first)
    return {
        "mode": mode, "regime": regime, "seed": seed, "job_s": time.monotonic() - start,
        "samples_per_s": samples / wall, "tokens_per_s": tokens / wall,
        "trainer_idle": sum(r.get("rollout/trainer_wait_s", 0.0) for r in after_first) / late_wall
        if mode != "sync" else None,
        "generator_idle": sum(r.get("rollout/generator_idle_s", 0.0) for r in after_first) / late_wall
        if mode != "sync" else None,
        "reward_last5": statistics.mean(r["reward/mean"] for r in rows[-5:]),
        "length_mean": statistics.mean(r["response_length/mean"] for r in rows),
        "stopped_frac": statistics.mean(r["response_length/stopped_frac"] for r in rows),
        "staleness_max": max(r.get("rollout/staleness_max", 0) for r in rows),
        "token_staleness": statistics.mean(r.get("rollout/token_staleness_mean", r.get("rollout/staleness_max", 0))
                                           for r in rows),
    }


def _percent(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regimes", default="cpu,floor")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3, help="sync seeds in the cpu regime (reward spread)")
    parser.add_argument("--floor-ms", type=float, default=25.0)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="async_bench_") as work:
        for regime in args.regimes.split(","):
            runs = [(mode, 1234) for mode in MODES]
            if regime == "cpu":
                runs += [("sync", 1234 + k) for k in range(1, args.seeds)]
            for mode, seed in runs:
                row = run_mode(mode, regime, seed, args.steps, args.floor_ms / 1000, work)
                results.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{args.steps} steps of 16 prompts x 8 samples, rollout.max_new_tokens=32; "
          f"floor regime: {args.floor_ms:g} ms per decode step (an emulation of a memory-bound GPU decode)")
    print("| regime | mode | ranks | trained samples/s | vs sync | generated tokens/s | trainer idle | "
          "generator idle | max staleness | token staleness | reward (last 5) | mean length | stopped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for regime in args.regimes.split(","):
        base = next(r for r in results if r["regime"] == regime and r["mode"] == "sync" and r["seed"] == 1234)
        for r in (r for r in results if r["regime"] == regime):
            ranks = "2 colocated" if r["mode"] == "sync" else "1 gen + 1 train"
            print(f"| {regime} | {r['mode']} (seed {r['seed']}) | {ranks} | {r['samples_per_s']:.1f} | "
                  f"{r['samples_per_s'] / base['samples_per_s']:.2f}x | {r['tokens_per_s']:.0f} | "
                  f"{_percent(r['trainer_idle'])} | {_percent(r['generator_idle'])} | {r['staleness_max']} | "
                  f"{r['token_staleness']:.2f} | "
                  f"{r['reward_last5']:.3f} | {r['length_mean']:.1f} | {100 * r['stopped_frac']:.0f}% |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
