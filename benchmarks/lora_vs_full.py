"""Does LoRA learn as full fine-tuning does?  GRPO on the demo task, LoRA against full fine-tuning.

    python benchmarks/lora_vs_full.py                       # 3 seeds x (full, LoRA rank 8), about 10 min on 2 cores
    python benchmarks/lora_vs_full.py --seeds 2 --ranks 4,16 --lora-lr 0.005 --lora-steps 90
    python benchmarks/lora_vs_full.py --set model.hidden_size=256 --set model.ffn_hidden_size=704   # a wider model

The base is what LoRA is used on: a model that already knows the task's format.  One run of
``configs/grpo_cpu.yaml`` does its supervised warm-up (full weights) and one GRPO step and saves;
every compared run starts from that checkpoint (``actor.init_checkpoint``, no warm-up of its own)
and trains ``--steps`` GRPO steps, fully (``actor.optim.lr`` of the recipe) or with LoRA adapters
on every projection (``--lora-lr``: LoRA's updates are low-rank and start from zero, so it takes a
larger rate, as peft recipes do).  The KL reference is the starting model in both (a copy for full
fine-tuning, the base with adapters off for LoRA).

Runs are interleaved: each seed runs every variant once, in an order rotated seed by seed.  Printed
per variant: the mean training reward of the first ``WINDOW`` steps, of the ``WINDOW`` steps up to
``--steps`` and of the last ``WINDOW`` steps over the seeds, the spread of the last over seeds,
seconds per step, and the first step whose ``WINDOW``-step mean reward reaches the full run's final
level minus 0.1 (how many steps LoRA needs to get as far, with ``--lora-steps``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIG = os.path.join(REPO, "configs", "grpo_cpu.yaml")
WINDOW = 5


def _train(run_dir: str, name: str, overrides: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_rl.tools.cli", "train", "--config", CONFIG, f"run.dir={run_dir}",
           f"run.name={name}", "trainer.plot=false", *overrides]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _window_means(rewards: list[float]) -> list[float]:
    return [statistics.mean(rewards[max(0, i - WINDOW + 1):i + 1]) for i in range(len(rewards))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--ranks", default="8", help="LoRA ranks to compare, comma-separated")
    ap.add_argument("--lora-lr", type=float, default=0.005)
    ap.add_argument("--full-lrs", default=None, help="full fine-tuning's learning rates, comma-separated (default "
                                                     "the recipe's): the target is the best one's final reward")
    ap.add_argument("--lora-steps", type=int, default=None, help="steps of the LoRA runs (default --steps): "
                                                                    "how long LoRA takes to reach the target")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, the base's too (e.g. model.hidden_size=256)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="lora_vs_full_")
    _train(work, "base", ["trainer.steps=1", "trainer.save_every=1", *args.set])
    base = os.path.join(work, "base", "checkpoints", "step_00000001")
    common = [f"actor.init_checkpoint={base}", "trainer.sft_warmup_steps=0", *args.set]
    lora_steps = args.lora_steps or args.steps
    full_lrs = args.full_lrs.split(",") if args.full_lrs else [None]
    variants = {("full" if lr is None else f"full lr {lr}"): [f"trainer.steps={args.steps}"]
                + ([f"actor.optim.lr={lr}"] if lr else []) for lr in full_lrs}
    for rank in (int(r) for r in args.ranks.split(",")):
        variants[f"lora r{rank}"] = [f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}",
                                     f"actor.optim.lr={args.lora_lr}", f"trainer.steps={lora_steps}"]
    names = list(variants)
    curves: dict[str, list[list[float]]] = {n: [] for n in names}
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for s in range(args.seeds):
        order = names[s % len(names):] + names[:s % len(names)]
        for name in order:
            rows = _train(work, f"{name.replace(' ', '_')}_s{s}", common + [f"run.seed={1234 + s}"] + variants[name])
            curves[name].append([r["reward/mean"] for r in rows])
            seconds[name].append(statistics.median(r["timing/step_s"] for r in rows))
    mean_curve = {n: [statistics.mean(c[i] for c in curves[n]) for i in range(len(curves[n][0]))] for n in names}
    target = max(_window_means(mean_curve[n])[-1] for n in names if n.startswith("full")) - 0.1
    print(f"GRPO on add_small from an SFT base, {args.seeds} seeds x {args.steps} steps (LoRA {lora_steps}); "
          f"reward = mean of "
          f"{WINDOW} steps; target = full's best final {target + 0.1:.3f} - 0.1")
    print(f"{'variant':<16} {'first':>7} {'at ' + str(args.steps):>7} {'last':>7} {'spread':>7} {'s/step':>7} "
          f"{'reaches target at':>18}")
    for name in names:
        lasts = [statistics.mean(c[-WINDOW:]) for c in curves[name]]
        at_full = statistics.mean(mean_curve[name][args.steps - WINDOW:args.steps])
        windows = _window_means(mean_curve[name])
        reached = next((i + 1 for i, v in enumerate(windows) if v >= target), None)
        print(f"{name:<16} {statistics.mean(mean_curve[name][:WINDOW]):>7.3f} {at_full:>7.3f} "
              f"{statistics.mean(lasts):>7.3f} {(max(lasts) - min(lasts)):>7.3f} "
              f"{statistics.median(seconds[name]):>7.2f} "
              f"{'step ' + str(reached) if reached else 'not within ' + str(len(windows)):>18}")


if __name__ == "__main__":
    main()
