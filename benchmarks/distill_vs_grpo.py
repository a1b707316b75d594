"""On-policy distillation against GRPO alone, at equal samples, on the CPU.

The teacher is trained by the project (``configs/distill_teacher_cpu.yaml``: a long supervised
warm-up on the digit_sum table); each student run is ``configs/distill_cpu.yaml`` from the same
start, distilled from that teacher (``reward_coef`` 0; with the batch-mean baseline and without;
optionally mixed with the reward) and with GRPO on the reward alone, seeds interleaved so machine
noise hits every variant alike.  Prints per run the mean reward of 5 steps at the start, at a third
and two thirds of the run and at its end, the first step where that mean reaches ``--share`` of the
teacher's reward, and the reverse KL to the teacher at the start and the end.

    python benchmarks/distill_vs_grpo.py [--seeds 3] [--steps 150] [--mix 0] [--share 0.5]
        [--teacher RUN_DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEACHER = os.path.join(ROOT, "configs", "distill_teacher_cpu.yaml")
STUDENT = os.path.join(ROOT, "configs", "distill_cpu.yaml")


def train(config: str, overrides: list[str]) -> list[dict]:
    """Harness body: one training run; its metrics rows."""
    import torch.distributed as dist

    from megatron_rl.config.loader import load_config
    from megatron_rl.trainer.metrics import read_metrics
    from megatron_rl.trainer.ppo import run_ppo
    from megatron_rl.validation import validate

    cfg = load_config(config, overrides)
    validate(cfg, dist.get_world_size())
    run_ppo(cfg, log=lambda line: None)
    return read_metrics(os.path.join(cfg.run.dir, cfg.run.name, "metrics.jsonl"))


def _mean5(values: list[float], end: int) -> float:
    window = values[max(0, end - 5):end]
    return sum(window) / len(window)


def _reached(rewards: list[float], target: float):
    return next((i for i in range(5, len(rewards) + 1) if _mean5(rewards, i) >= target), None)


def main() -> int:
    sys.path.insert(0, ROOT)
    from megatron_rl.testing.harness import importable_script, run_distributed

    this = importable_script(__file__, globals().get("__spec__"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--mix", type=float, default=1.0, help="reward_coef of the mixed run (0: leave it out)")
    parser.add_argument("--share", type=float, default=0.5, help="the share of the teacher's reward to reach")
    parser.add_argument("--teacher", help="run directory of an earlier teacher run to reuse (default: train one)")
    parser.add_argument("--teacher-overrides", nargs="*", default=[], help="overrides of the teacher run")
    parser.add_argument("--modes", default=None, help="the runs to make, comma-separated (default every one: "
                                                      "distill, grpo, distill+reward with --mix, distill, no baseline)")
    parser.add_argument("overrides", nargs="*", help="overrides of every student run (key=value)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="distill_vs_grpo_")
    start = time.monotonic()
    if args.teacher:
        from megatron_rl.trainer.metrics import read_metrics

        teacher = args.teacher
        teacher_rows = read_metrics(os.path.join(teacher, "metrics.jsonl"))
    else:
        teacher_rows = run_distributed(1, this.train, TEACHER, [f"run.dir={work}", *args.teacher_overrides],
                                       timeout=1800.0)[0]
        teacher = os.path.join(work, "distill_teacher_cpu")
    # The teacher's reward: the mean over its RL steps (the recipe's rate of 1e-6 leaves it where its warm-up
    # put it; more steps, e.g. --teacher-overrides trainer.steps=20, measure it on more prompts).
    teacher_reward = sum(r["reward/mean"] for r in teacher_rows) / len(teacher_rows)
    print(f"teacher: reward {teacher_reward:.3f} after its warm-up, the mean of {len(teacher_rows)} step(s) "
          f"({time.monotonic() - start:.0f} s)")
    modes = {"distill": (STUDENT, [f"algorithm.distill.teachers={{default: {teacher}}}"]),
             "grpo": (STUDENT, ["algorithm.distill.teachers={}"])}
    if args.mix:
        modes["distill+reward"] = (STUDENT, modes["distill"][1] + [f"algorithm.distill.reward_coef={args.mix}"])
    modes["distill, no baseline"] = (STUDENT, modes["distill"][1] + ["algorithm.distill.baseline=none"])
    if args.modes:
        unknown = set(args.modes.split(",")) - set(modes)
        if unknown:
            parser.error(f"--modes: unknown {sorted(unknown)}; choose from {sorted(modes)}")
        modes = {m: modes[m] for m in args.modes.split(",")}
    marks = [m for m in (args.steps // 3, 2 * args.steps // 3) if m >= 5]
    print(f"{'run':<22} {'seed':>4} {'first 5':>8} " + "".join(f"{f'to {m}':>8} " for m in marks)
          + f"{'last 5':>8} {f'{args.share}x teacher at':>16} {'KL start':>9} {'KL end':>7}")
    for seed in range(1, args.seeds + 1):
        for mode, (config, extra) in modes.items():  # interleaved: each seed runs every mode back to back
            rows = run_distributed(1, this.train, config, extra + [
                f"run.dir={work}", f"run.name={mode}_{seed}", f"run.seed={seed}", f"trainer.steps={args.steps}",
                f"actor.optim.lr={args.lr}", *args.overrides], timeout=max(300.0, 3.0 * args.steps))[0]
            rewards = [r["reward/mean"] for r in rows]
            kl = [r.get("distill/reverse_kl") for r in rows]
            reached = _reached(rewards, args.share * teacher_reward)
            kl_text = (f"{_mean5(kl, 5):9.3f} {_mean5(kl, len(kl)):7.3f}" if kl[0] is not None
                       else f"{'-':>9} {'-':>7}")
            middle = "".join(f"{_mean5(rewards, m):8.3f} " for m in marks)
            print(f"{mode:<22} {seed:>4} {_mean5(rewards, 5):8.3f} {middle}{_mean5(rewards, len(rewards)):8.3f} "
                  f"{('step ' + str(reached)) if reached else 'not reached':>16} {kl_text}", flush=True)
    print(f"({time.monotonic() - start:.0f} s in all; runs in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
