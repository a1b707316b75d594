"""Disk space for checkpoints: a save that cannot fit stops with one line, and nothing a failed
save leaves behind blocks the next run.

Before a checkpoint is written, every rank agrees on the space it needs (the newest complete
checkpoint's size, or an estimate from the parameters and the optimizer when there is none yet)
and on what rank 0's disk has free; when it does not fit, the save stops before writing anything,
naming the directory and both figures.  When the disk fills anyway (another writer, a quota, a
file-size limit, an estimate that was short), the failure from whichever layer hit it (our own
file, megatron-core's writer, torch's distributed checkpoint) is recognised and reported the same
way, and the partial ``step_*.tmp`` is removed.  Temporaries of an earlier failed save are removed
before the next save and before a job writes its ``config.yaml``, so a disk kept full by them
never stops a run.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.distributed import collectives
from megatron_rl.distributed.runtime import active_groups
from megatron_rl.errors import StorageError
from megatron_rl.utils.run_files import SPACE_ERRNOS

STEP_TEMPORARY_SUFFIX = ".tmp"
MIB = 1 << 20
# A disk with less than this free after a failed save is full, whatever the failure said.
FULL_DISK_BYTES = MIB
# What a checkpoint holds besides the tensors (metadata, RNG states, step counters), relative to
# them: measured 15-20% for the tiny test models, less for large ones; the first checkpoint's
# estimate errs on the large side.
_OVERHEAD = 1.25
# Adam keeps two fp32 moments per parameter, and an fp32 master copy of a parameter held in
# another dtype: the estimate for a first checkpoint, when there is no earlier one to measure.
_ADAM_STATE_BYTES = {True: 8, False: 12}


def out_of_space(err: BaseException) -> bool:
    """Whether ``err`` (or anything it wraps) is a write that found the disk full.  megatron-core's
    writer processes send their ``OSError`` back as the cause of a ``RuntimeError("Worker failure")``;
    torch's distributed checkpoint gathers each rank's failure into a ``CheckpointException``."""
    from torch.distributed.checkpoint.api import CheckpointException  # 2 s to import: not at launch

    stack: list[Optional[BaseException]] = [err]
    seen: set[int] = set()
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS:
            return True
        if isinstance(exc, CheckpointException):
            stack.extend(pair[0] if isinstance(pair, tuple) else pair for pair in exc.failures.values())
        stack.extend((exc.__cause__, exc.__context__))
    return False


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def failed_for_space(err: BaseException, root: str, partial: str, needed: float) -> bool:
    """Whether a save that raised ``err`` failed because the disk filled: by the error itself, or,
    where a layer dropped the ``OSError`` (megatron-core 0.19's writer reports only its type), by
    the disk: next to nothing is free, or what is free plus what the partial save holds is less
    than the checkpoint needs."""
    if out_of_space(err):
        return True
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return False
    return free < FULL_DISK_BYTES or free + _tree_bytes(partial) < needed


def remove_stale_temporaries(root: str) -> list[str]:
    """Remove what an interrupted or failed save left under ``root`` (``step_*.tmp``,
    ``latest.tmp``); returns the removed names.  Only one job writes a run's checkpoints, so
    outside a save every temporary there is stale."""
    if not os.path.isdir(root):
        return []
    removed = []
    for name in sorted(os.listdir(root)):
        if name.startswith("step_") and name.endswith(STEP_TEMPORARY_SUFFIX) or name == "latest.tmp":
            path = os.path.join(root, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except OSError:
                    pass
            removed.append(name)
    return removed


def _newest_size(root: str) -> int:
    """Bytes of the newest complete checkpoint under ``root`` (from its ``meta.json``), or 0.  A
    ``meta.json`` that is not a manifest (not JSON, nested too deep, sizes that are not whole
    numbers) is passed over: the loader reports it, and the save must not stop on it."""
    if not os.path.isdir(root):
        return 0
    for name in sorted(os.listdir(root), reverse=True):
        meta = os.path.join(root, name, "meta.json")
        if not (name.startswith("step_") and os.path.isfile(meta) and not os.path.islink(meta)):
            continue
        try:
            with open(meta) as fh:
                info = json.load(fh)
        except (OSError, ValueError, RecursionError):
            continue
        files = info.get("files") if isinstance(info, dict) and info.get("complete") is True else None
        sizes = list(files.values()) if isinstance(files, dict) else None
        if sizes is None or not all(type(size) is int and size >= 0 for size in sizes):
            continue
        return sum(sizes) + os.path.getsize(meta)
    return 0


# ModelPart.only (engine/checkpoint.py): which of a model's tensors a checkpoint part holds.
ONLY_TRAINED = "trained"  # what trains (LoRA adapters, a critic's value head): the frozen base is not saved
ONLY_BASE = "base"  # everything but LoRA adapters (a LoRA run starting from a full checkpoint's weights)


def _local_estimate(parts: dict, with_optimizer: bool) -> int:
    """Bytes this rank's parameters (and Adam's state for them) take in a checkpoint."""
    total = 0
    for part in parts.values():
        with_state = with_optimizer and part.optimizer is not None
        for chunk in part.chunks:
            for param in chunk.parameters():
                if part.only == ONLY_TRAINED and not param.requires_grad:
                    continue  # a LoRA part: the frozen base is not written
                total += param.numel() * param.element_size()
                if with_state:
                    total += param.numel() * _ADAM_STATE_BYTES[param.dtype == torch.float32]
    return total


def _replicas() -> int:
    """How many ranks hold the same parameters (data and context parallel copies)."""
    try:
        return active_groups().dp_cp.size()
    except (AssertionError, AttributeError, RuntimeError, TypeError):
        return 1


def _size(nbytes: float) -> str:
    return f"{nbytes / MIB:.3g} MiB"


def space_error(root: str, step: int, needed: float, free: Optional[float], keep_last: int) -> StorageError:
    have = "the disk is full" if free is None else f"{_size(free)} free"
    keep = f"keep fewer checkpoints (trainer.keep_last={keep_last} now), " if keep_last > 1 else ""
    return StorageError(root, None, f"not enough disk space for the step {step} checkpoint: {have}, "
                        f"it needs about {_size(needed)}; nothing of it was kept",
                        f"free space on that disk, {keep}or set run.dir to a larger disk; the last good "
                        "checkpoint is untouched and trainer.resume=auto continues from it")


def require_space(root: str, step: int, parts: dict, with_optimizer: bool, keep_last: int) -> float:
    """Bytes the step's checkpoint needs; raises :class:`StorageError` on every rank when rank 0's
    disk under ``root`` has less free.  A collective (one all-reduce)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    free = float(shutil.disk_usage(root).free) if rank0 else 0.0
    newest = float(_newest_size(root)) if rank0 else 0.0
    local, free, newest = collectives.all_reduce(
        torch.tensor([float(_local_estimate(parts, with_optimizer)), free, newest], dtype=torch.float64)).tolist()
    needed = newest or _OVERHEAD * local / _replicas()
    if free < needed:
        raise space_error(root, step, needed, free, keep_last)
    return needed
