"""Trained samples per second of ``sync`` on 2 colocated ranks against ``one_step_off`` and
``async`` (with and without partial rollouts) on 1 generator rank and 1 training rank
(``rollout.ranks=1``), same model, prompts, samples and steps.

    python benchmarks/async_throughput.py                      # both regimes, 2 rounds, about 10 min on 2 cores
    python benchmarks/async_throughput.py --regimes floor --modes sync,one_step_off,async --floor-ms 8
    python benchmarks/async_throughput.py --batching auto      # static batching (the CPU's auto) generating
    python benchmarks/async_throughput.py --regimes cpu --rounds 1 --seeds 6 --correction is   # the reward study

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
  (of megatron's dynamic engine, or of its static batching with ``--batching static``) a floor of
  ``--floor-ms`` whatever its rows (prefill and training untouched), so a batch costs its longest
  response, as on a GPU.  The default is where one generating rank keeps pace with one training
  rank on this model (:data:`BALANCED_FLOOR_MS`: 2.5 ms for the dynamic engine, whose bookkeeping
  between steps adds to the floor, 3 ms otherwise); above it generation sets the pace and
  the trainer waits (a job would give generation more ranks: ``megatron-rl plan
  --generator-gpus``), which ``--floor-ms 8`` shows.

Every run generates with megatron-core's engine, the product's generator on every layout, by
default batching dynamically (``rollout.batching=dynamic``) in every mode, partial rollouts
included; ``--batching auto`` runs the CPU's default, static batching, except with partial
rollouts (which only the dynamic engine runs).

Per mode: trained samples/s and generated tokens/s over the sum of the trainer's ``timing/step_s``
(rollout or the wait for it, reward, experience, update and weight push; not start-up, warm-up or
the final checkpoint), each side's idle fraction (the trainer's wait for batches, the generators'
wait for requests), the mean training reward of the last ``REWARD_STEPS`` steps, and in the cpu
regime the reward of the policy each run ends with (an evaluation on the task's prompts after
the last step, untimed: a stale mode's training reward is an older policy's; one policy's reward
swings from step to step here, so the target reads the training reward of the last steps).  Every
mode runs ``--seeds`` seeds in the cpu regime: the reward target sets each stale mode's mean over
its seeds against the spread of the ``sync`` seeds (the stale modes' extra seeds run once, after
the rounds, and count only for the reward).  Runs are interleaved
(``--rounds``): each round runs every mode once, in an order rotated round by round, and each
mode's speed-up is taken against the ``sync`` run of its own round, so the machine's slow spells
do not fall on one mode; the table prints medians over rounds and every round's ratio, then each
target with PASS or FAIL.
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

FIRST_SEED = 1234
REWARD_STEPS = 10  # the training reward: the mean over the last steps (one step's 128 samples are noisy)
# The final policy's reward: the task's 20 prompts x 32 samples at the training temperature.
EVALUATION = ["data.val_path=task:add_small", "eval.n=32", "eval.temperature=1.0"]
# The floor at which one generating rank keeps pace with one training rank on this workload (measured:
# async idle 2-9% trainer / 6-10% generator on megatron's engine at 2.5 ms, 7-23% trainer at 3 ms).
BALANCED_FLOOR_MS = {"dynamic": 2.5, "auto": 3.0, "static": 3.0}
SAMPLES_PER_STEP = 16 * 8  # configs/grpo_cpu.yaml: trainer.prompts_per_step x rollout.n
MODES = {
    "sync": ["--nproc", "2"],
    "one_step_off": ["--nproc", "2", "rollout.ranks=1", "trainer.mode=one_step_off"],
    "async": ["--nproc", "2", "rollout.ranks=1", "trainer.mode=async", "trainer.max_staleness=2"],
    "async_partial": ["--nproc", "2", "rollout.ranks=1", "trainer.mode=async", "trainer.max_staleness=2",
                      "trainer.partial_rollouts=true"],
}

def run_mode(mode: str, regime: str, seed: int, steps: int, floor_s: float, work: str,
             batching: str = "dynamic", correction: str | None = None) -> dict:
    name = f"{mode}_{regime}_{seed}"
    env = job_env(long_tail=True, decode_floor_s=floor_s if regime == "floor" else 0.0)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], REPO])
    env.pop("MEGATRON_RL_FAULT", None)
    # The cpu regime also evaluates the policy every run ends with (after the same trained samples),
    # outside the timed steps.
    evaluate = [f"trainer.eval_every={steps}", *EVALUATION] if regime == "cpu" else []
    cmd = [sys.executable, "-m", "megatron_rl.tools.cli", "train", "--config",
           os.path.join(REPO, "configs", "grpo_cpu.yaml"), *MODES[mode], "rollout.max_new_tokens=32",
           f"trainer.steps={steps}", f"run.seed={seed}", f"run.dir={work}", f"run.name={name}", "trainer.plot=false",
           f"rollout.batching={batching}", *evaluate]
    if correction and mode != "sync":  # the stale modes' correction (sync samples from the weights it trains)
        cmd.append(f"algorithm.rollout_correction.mode={correction}")
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(work, name, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if '"step"' in line]
    final = [r["eval/reward_mean"] for r in rows if r.get("step") == steps and "eval/reward_mean" in r]
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
        "reward_last": statistics.mean(r["reward/mean"] for r in rows[-REWARD_STEPS:]),
        "reward_final": final[0] if final else None,
        "length_mean": statistics.mean(r["response_length/mean"] for r in rows),
        "stopped_frac": statistics.mean(r["response_length/stopped_frac"] for r in rows),
        "staleness_max": max(r.get("rollout/staleness_max", 0) for r in rows),
        "staleness_shares": staleness_shares(rows),
        "token_staleness": statistics.mean(r.get("rollout/token_staleness_mean", r.get("rollout/staleness_max", 0))
                                           for r in rows),
    }


def staleness_shares(rows: list[dict]) -> dict[int, float]:
    """The share of trained samples at each staleness, from each step's samples: every sample of a
    batch shares its version (without partial rollouts), so a step's median is each sample's;
    with partial rollouts a sample counts at its step's median (its oldest token's version)."""
    counts: dict[int, int] = {}
    for r in rows:
        s = int(r.get("rollout/staleness_p50", r.get("rollout/staleness_max", 0)))
        counts[s] = counts.get(s, 0) + 1
    return {s: counts[s] / len(rows) for s in sorted(counts)} if rows else {}


def _reward(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _percent(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def interleaved(runs: list, rounds: int) -> list:
    """``(round, mode, seed)`` in the order they run: every round runs each of ``runs`` once,
    starting one further along each round, so a slow spell of the machine falls on different modes."""
    out = []
    for r in range(rounds):
        k = r % len(runs)
        out += [(r, *run) for run in runs[k:] + runs[:k]]
    return out


def summarise(results: list, regime: str) -> list[dict]:
    """One row per (mode, seed) of ``regime``: medians over the rounds, and each round's ratio to
    that round's ``sync`` run of the first seed."""
    rows = [r for r in results if r["regime"] == regime]
    base = {r["round"]: r["samples_per_s"] for r in rows if r["mode"] == "sync" and r["seed"] == FIRST_SEED}
    out = []
    for key in dict.fromkeys((r["mode"], r["seed"]) for r in rows):
        runs = [r for r in rows if (r["mode"], r["seed"]) == key]
        ratios = [r["samples_per_s"] / base[r["round"]] for r in runs if r["round"] in base]
        out.append(dict(mode=key[0], seed=key[1], rounds=len(runs), ratios=ratios, vs_sync=_median(ratios),
                        **{k: _median(r[k] for r in runs) for k in (
                            "samples_per_s", "tokens_per_s", "trainer_idle", "generator_idle", "staleness_max",
                            "token_staleness", "reward_last", "reward_final", "length_mean", "stopped_frac")}))
    return out


def target_lines(summaries: dict) -> list[str]:
    """The targets of the benchmark, each with what this run measured (medians over rounds)."""
    lines = []

    def check(ok, text):
        lines.append(f"{'PASS' if ok else 'FAIL'}  {text}")

    floor = {r["mode"]: r for r in summaries.get("floor", []) if r["seed"] == FIRST_SEED}
    for mode, need in (("async", 1.5), ("one_step_off", 1.25)):
        if mode in floor:
            check(floor[mode]["vs_sync"] >= need, f"floor: {mode} {floor[mode]['vs_sync']:.2f}x sync (>= {need}x)")
    cpu = summaries.get("cpu", [])
    # Speed and idle: the first seed's interleaved rounds (the other seeds run once, for the reward).
    for r in (r for r in cpu if r["mode"] != "sync" and r["seed"] == FIRST_SEED):
        check(r["vs_sync"] >= 0.9, f"cpu: {r['mode']} {r['vs_sync']:.2f}x sync (no more than 10% slower)")
    for regime, rows in summaries.items():
        for r in (r for r in rows if r["mode"] == "async" and r["seed"] == FIRST_SEED):
            idle = max(r["trainer_idle"], r["generator_idle"])
            check(idle <= 0.15, f"{regime}: async idle trainer {_percent(r['trainer_idle'])} / generator "
                                f"{_percent(r['generator_idle'])} (each <= 15%)")
    # The training reward of the last steps: it averages ten policies (one policy's own reward swings
    # by 0.1 from step to step on this task), and a stale mode's is its older policies', which only
    # makes the check harder for it to pass.
    # A stale mode's reward per trained sample is the mean over its seeds (one seed's draws move it by
    # as much as the modes differ), set against the spread of the sync seeds.
    sync_rewards = [r["reward_last"] for r in cpu if r["mode"] == "sync"]
    if len(sync_rewards) > 1:
        low, high = min(sync_rewards), max(sync_rewards)
        for mode in dict.fromkeys(r["mode"] for r in cpu if r["mode"] != "sync"):
            seeds = [r for r in cpu if r["mode"] == mode]
            mean = statistics.mean(r["reward_last"] for r in seeds)
            each = " / ".join(f"{r['reward_last']:.3f}" for r in seeds)
            check(mean >= low,
                  f"cpu: {mode} reward {mean:.3f} (last {REWARD_STEPS} steps, mean of {len(seeds)} seed(s): {each}) "
                  f"within the sync seeds' spread {low:.3f}-{high:.3f} (or above it)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regimes", default="cpu,floor")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3, help="seeds of every mode in the cpu regime (the reward: "
                        "sync's spread, the other modes' mean); the other modes' extra seeds run once")
    parser.add_argument("--rounds", type=int, default=2, help="repeats of every run, interleaved round by round")
    parser.add_argument("--modes", default=",".join(MODES), help="modes to run (sync always)")
    parser.add_argument("--floor-ms", type=float, help="the floor regime's time per decode step (default: where "
                        "one generating rank keeps pace with one training rank, per batching: "
                        + ", ".join(f"{k} {v:g} ms" for k, v in BALANCED_FLOOR_MS.items()) + ")")
    parser.add_argument("--batching", default="dynamic", choices=["dynamic", "static", "auto"],
                        help="rollout.batching of every run (auto: static batching on the CPU, dynamic with "
                             "partial rollouts)")
    parser.add_argument("--correction", help="algorithm.rollout_correction.mode of the stale modes (default: auto, "
                        "resolved per mode)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.floor_ms is None:
        args.floor_ms = BALANCED_FLOOR_MS[args.batching]
    modes = ["sync"] + [m for m in args.modes.split(",") if m in MODES and m != "sync"]
    regimes = args.regimes.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="async_bench_") as work:
        for regime in regimes:
            runs = [(mode, FIRST_SEED) for mode in modes]
            if regime == "cpu":
                runs += [("sync", FIRST_SEED + k) for k in range(1, args.seeds)]
            order = interleaved(runs, args.rounds)
            if regime == "cpu":  # the other modes' seeds, once, for the reward (speed reads the first seed's rounds)
                order += [(0, mode, FIRST_SEED + k) for mode in modes[1:] for k in range(1, args.seeds)]
            for rnd, mode, seed in order:
                row = run_mode(mode, regime, seed, args.steps, args.floor_ms / 1000, os.path.join(work, str(rnd)),
                               args.batching, args.correction)
                row["round"] = rnd
                results.append(row)
                print(json.dumps(row), flush=True)
    summaries = {regime: summarise(results, regime) for regime in regimes}
    print(f"\n{args.steps} steps of 16 prompts x 8 samples, rollout.max_new_tokens=32, {args.rounds} interleaved "
          f"round(s), rollout.batching={args.batching}, rollout correction of the stale modes: "
          f"{args.correction or 'auto'}, medians over rounds; floor regime: {args.floor_ms:g} ms per "
          "decode step (an emulation of a memory-bound GPU decode)")
    print("| regime | mode | ranks | trained samples/s | vs sync (each round) | generated tokens/s | trainer idle | "
          f"generator idle | max staleness | token staleness | reward (last {REWARD_STEPS}) | final policy's reward | "
          "mean length | stopped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for regime in regimes:
        for r in summaries[regime]:
            ranks = "2 colocated" if r["mode"] == "sync" else "1 gen + 1 train"
            each = " / ".join(f"{x:.2f}" for x in r["ratios"])
            print(f"| {regime} | {r['mode']} (seed {r['seed']}) | {ranks} | {r['samples_per_s']:.1f} | "
                  f"{r['vs_sync']:.2f}x ({each}) | {r['tokens_per_s']:.0f} | "
                  f"{_percent(r['trainer_idle'])} | {_percent(r['generator_idle'])} | {r['staleness_max']:g} | "
                  f"{r['token_staleness']:.2f} | "
                  f"{r['reward_last']:.3f} | {_reward(r['reward_final'])} | {r['length_mean']:.1f} | "
                  f"{100 * r['stopped_frac']:.0f}% |")
    print("\nstaleness of the trained samples (share at each number of versions behind), first round:")
    for r in results:
        if r["round"] == 0 and r["mode"] != "sync" and r["seed"] == FIRST_SEED:
            shares = ", ".join(f"{s}: {_percent(x)}" for s, x in r["staleness_shares"].items())
            print(f"  {r['regime']} {r['mode']}: {shares}")
    print()
    for line in target_lines(summaries):
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
