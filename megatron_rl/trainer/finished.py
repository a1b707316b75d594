"""A run that has nothing left to do, recognised before any rank starts or any model is built.

``trainer.resume=auto`` (the default) continues from the newest checkpoint of the run directory;
when that checkpoint is already at ``trainer.steps``, running the same command again only says so,
in one line, and exits 0.  Reads the file system only (meta.json of the checkpoint).
"""

from __future__ import annotations

import os
from typing import Optional


def run_dir_of(cfg) -> str:
    return os.path.join(cfg.run.dir, cfg.run.name)


def finished_step(cfg) -> Optional[int]:
    """The step of the checkpoint this run would resume from, when it is >= ``trainer.steps``; else None."""
    mode = cfg.trainer.resume
    if mode == "never":
        return None
    from megatron_rl.engine import checkpoint
    from megatron_rl.errors import CheckpointError

    # A probe: a checkpoint passed over here is reported once, by the trainer's own load.
    path = checkpoint.find_latest(os.path.join(run_dir_of(cfg), "checkpoints"), warn=False) if mode == "auto" \
        else mode
    if path is None:
        return None
    try:
        step = checkpoint.check_checkpoint(path)["step"]  # a whole number once the manifest passed
    except CheckpointError:
        return None  # the trainer's own load reports what is wrong with it
    return step if step >= cfg.trainer.steps else None


def finished_message(cfg, step: int) -> str:
    run_dir = run_dir_of(cfg)
    return (f"run finished: step {step} of trainer.steps={cfg.trainer.steps} is done in {run_dir}; nothing to do. "
            f"To train further: trainer.steps=<more than {step}>; to start fresh: run.name=<new name>, "
            f"or trainer.resume=never (moves this run's checkpoints and metrics to {run_dir}/replaced/)")


# What a run writes into its directory; all of it moves together, so a set-aside run is whole.
RUN_FILES = ("checkpoints", "metrics.jsonl", "samples", "tb", "plot.png", "config.yaml")
# Set in the environment once the launcher has moved the previous run aside (before it wrote the new
# run's config.yaml), so the ranks do not move the new run's files.
SET_ASIDE_ENV = "MEGATRON_RL_PREVIOUS_RUN_SET_ASIDE"


def set_aside_previous_run(run_dir: str) -> str | None:
    """Move an earlier run's files (:data:`RUN_FILES`: checkpoints, metrics, samples, TensorBoard,
    plot, ``config.yaml``) out of the way of a fresh start (``trainer.resume=never``) into
    ``<run_dir>/replaced/<UTC time>/``; returns that directory, or None when there was nothing to move.

    A fresh run must neither resume from nor delete another run's checkpoints: left in place, the
    old run's higher step numbers would outrank the new checkpoints (retention would delete the new
    ones) and a later ``trainer.resume=auto`` would continue the old run.  Nothing is deleted, and
    the moved directory is a run directory of its own: ``--config <it>/config.yaml run.dir=<run
    dir>/replaced run.name=<time>`` resumes the old run."""
    names = [n for n in RUN_FILES if os.path.lexists(os.path.join(run_dir, n))]
    if not names:
        return None
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = os.path.join(run_dir, "replaced", stamp)
    suffix = 1
    while os.path.exists(target):
        suffix += 1
        target = os.path.join(run_dir, "replaced", f"{stamp}-{suffix}")
    os.makedirs(target)
    for name in names:
        os.replace(os.path.join(run_dir, name), os.path.join(target, name))
    return target


def set_aside_message(moved: str) -> str:
    return f"trainer.resume=never: the previous run (checkpoints, metrics, config.yaml) moved to {moved}"
