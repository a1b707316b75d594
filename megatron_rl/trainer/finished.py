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

    path = checkpoint.find_latest(os.path.join(run_dir_of(cfg), "checkpoints")) if mode == "auto" else mode
    if path is None:
        return None
    try:
        step = int(checkpoint.check_checkpoint(path)["step"])
    except (CheckpointError, KeyError, ValueError):
        return None  # the trainer's own load reports what is wrong with it
    return step if step >= cfg.trainer.steps else None


def finished_message(cfg, step: int) -> str:
    run_dir = run_dir_of(cfg)
    return (f"run finished: step {step} of trainer.steps={cfg.trainer.steps} is done in {run_dir}; nothing to do. "
            f"To train further: trainer.steps=<more than {step}>; to start fresh: run.name=<new name>, "
            f"or trainer.resume=never (overwrites {run_dir})")
