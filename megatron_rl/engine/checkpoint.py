"""Checkpoints: Megatron ``dist_checkpointing``, written atomically, loadable into any layout.

Layout of a checkpoint directory::

    <root>/step_00000012/
        meta.json              step, format, model configs, which parts it holds; written last
        actor/  critic/ ...    one dist_checkpointing directory per model (+ optimizer, scheduler)
        trainer_state.pt       run state shared by all ranks (data position, KL controller, ...)
        rng/rank_00003.pt      each rank's RNG states
        tokenizer/             the run's tokenizer files and generation_config.json (HF models)
    <root>/latest              name of the newest complete checkpoint

Everything is written into ``step_XXXXXXXX.tmp`` and renamed only after every rank finished and
``meta.json`` is on disk, so a crash (or a full disk) mid-save never touches the last good
checkpoint.  Every file's sha256 is in ``meta.json`` and checked before loading, and a file it
does not list, a link or a manifest of another shape makes the checkpoint a bad one;
:func:`load_newest` (the trainer's ``resume=auto``) skips a checkpoint that does not load and falls
back to the previous good one, and :func:`find_latest` finds the newest complete one by size alone
(without reading it).  Tensors are stored sharded by their global names, so a
checkpoint saved on one TP/PP/VPP layout loads into another.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import stat
import time
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.compat import safe_unpickling, weights_only_common
from megatron_rl.compat.megatron_fixes import (
    distributed_optimizer_checkpoint_metadata,
    init_distributed_optimizer_state,
)
from megatron_rl.compat.safe_unpickling import UnsafeCheckpointFile
from megatron_rl.distributed import collectives, faults
from megatron_rl.distributed.runtime import overriding_groups
from megatron_rl.engine import checkpoint_space
from megatron_rl.engine.checkpoint_space import ONLY_BASE, ONLY_TRAINED
from megatron_rl.errors import CheckpointError
from megatron_rl.models.lora.base import check_lora_base

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# The files a checkpoint keeps beside ``meta.json``: the tokenizer and generation config of the run
# (copied at save time), so that ``convert`` and ``generate`` never open a directory that
# ``meta.json`` names.
COMPANIONS_DIR = "tokenizer"
MANIFEST = "meta.json"
# A manifest lists a few entries per file; far larger than any real one is not a manifest.
MANIFEST_MAX_BYTES = 256 << 20
_PART_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_EARLIER = "use an earlier checkpoint"
log = logging.getLogger("megatron_rl.checkpoint")


@dataclasses.dataclass
class ModelPart:
    """One model to checkpoint: its chunks (DDP-wrapped or not) and optional optimizer/scheduler.
    ``only``: None for every tensor, else :data:`ONLY_TRAINED` or :data:`ONLY_BASE`."""

    chunks: list
    optimizer: Any = None
    scheduler: Any = None
    only: Optional[str] = None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    collectives.barrier()


def _inner(chunk):
    from megatron_rl.models.canonical import unwrap

    return unwrap(chunk)


def _selected(state: dict, only: Optional[str]) -> dict:
    """``state`` (a chunk's sharded state dict) cut to what ``only`` asks for."""
    from megatron_rl.layout.lora import is_adapter_param

    if only == ONLY_TRAINED:
        return {k: v for k, v in state.items() if getattr(getattr(v, "data", None), "requires_grad", False)}
    if only == ONLY_BASE:
        return {k: v for k, v in state.items() if not is_adapter_param(k)}
    return state


def _model_sharded(chunks: list, only: Optional[str] = None) -> dict:
    # A model on a layout of its own (a distillation teacher, layout_active) names its shards'
    # replicas by its own data-parallel group; megatron reads parallel_state's unless told.
    groups = overriding_groups()
    metadata = {"dp_cp_group": groups.dp_cp} if groups is not None else None
    if len(chunks) == 1:
        return {"model": _selected(_inner(chunks[0]).sharded_state_dict(metadata=metadata), only)}
    return {f"model{i}": _selected(_inner(c).sharded_state_dict(metadata=metadata), only)
            for i, c in enumerate(chunks)}


def _part_sharded(part: ModelPart, with_optimizer: bool, loading: bool = False) -> dict:
    state = _model_sharded(part.chunks, part.only)
    if with_optimizer and part.optimizer is not None:
        if loading:
            init_distributed_optimizer_state(part.optimizer)
        # is_loading creates Adam's moment tensors before the first step; without them nothing
        # of the optimizer state would be requested, and a resumed run would silently restart Adam.
        state["optimizer"] = part.optimizer.sharded_state_dict(
            state, is_loading=loading, metadata=distributed_optimizer_checkpoint_metadata())
    if with_optimizer and part.scheduler is not None:
        state["scheduler"] = part.scheduler.state_dict()
    return state


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _file_sizes(root: str) -> dict[str, int]:
    sizes = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            sizes[os.path.relpath(full, root)] = os.path.getsize(full)
    return sizes


CHECKSUM = "sha256"
# The fix a refused (code-running) checkpoint file gets.
REFUSED_FIX = "load only checkpoints this project wrote; nothing from the file was run"


def _digest(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, CHECKSUM).hexdigest()


# Files one rank hashes at once (hashlib releases the GIL while it hashes) ...
CHECKSUM_THREADS = 8
# ... and the files each rank writes per part (megatron's default is one): one file can only be
# hashed by one thread, so a one-file rank hashed its whole share of the checkpoint on one core.
FILES_PER_RANK = 4


def _save_strategy():
    """megatron's torch_dist save strategy, writing :data:`FILES_PER_RANK` files per rank (from as
    many threads)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=FILES_PER_RANK)


def _checksums(root: str, names: list[str]) -> dict[str, str]:
    """``sha256`` of every file in ``names`` (relative to ``root``), each rank hashing every
    world-th file, several at once, gathered on every rank: a collective, and reading the
    checkpoint back once, spread over the ranks and their cores."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    share = names[_rank()::world]
    threads = max(1, min(CHECKSUM_THREADS, len(share), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        mine = dict(zip(share, pool.map(lambda name: _digest(os.path.join(root, name)), share)))
    out: dict[str, str] = {}
    for part in collectives.all_gather_object(mine):
        out.update(part)
    return out


def verify_contents(path: str, meta: dict) -> None:
    """Compare every file with the checksum written beside it (a collective: every rank hashes a
    share); :class:`CheckpointError` on every rank naming the first altered file.  ``meta`` passed
    :func:`check_checkpoint`: every file there has a checksum."""
    expected = meta["checksums"]
    got = _checksums(path, sorted(expected))
    bad = [name for name in sorted(expected) if got.get(name) != expected[name]]
    if bad:
        raise CheckpointError("checkpoint", path, f"file {bad[0]} does not match its {CHECKSUM} checksum "
                              f"({len(bad)} altered file(s)): corrupted after it was written",
                              "use an earlier checkpoint")


def _write_json(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    """This rank's RNG states as plain data (tensors, tuples, numbers), so they load with
    ``weights_only=True``: numpy's key array is stored as a list."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    try:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state["tracker"] = get_cuda_rng_tracker().get_states()
    except (ImportError, RuntimeError, AssertionError):  # tracker not initialised
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "tracker" in state:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(
    root: str,
    step: int,
    parts: dict[str, ModelPart],
    *,
    trainer_state: Optional[dict] = None,
    meta: Optional[dict] = None,
    keep_last: int = 0,
    with_optimizer: bool = True,
) -> str:
    """Save atomically; every rank must call.  Returns the final directory.

    Weights that are not finite are never written: the save raises :class:`CheckpointError` on
    every rank and the last good checkpoint stays the newest.  A checkpoint that does not fit on
    the disk stops with :class:`StorageError` (see :mod:`checkpoint_space`)."""
    from megatron_rl.engine.trainable import weights_finite

    final = os.path.join(root, step_dir_name(step))
    for name, part in parts.items():
        if not weights_finite(part.chunks):
            raise CheckpointError("checkpoint", final, f"the {name} weights hold NaN or infinite values; "
                                  "nothing was written", "the last good checkpoint is kept; resume from it with a "
                                  "lower learning rate (or float32 if bfloat16 overflows)")
    tmp = final + checkpoint_space.STEP_TEMPORARY_SUFFIX
    start = time.perf_counter()
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        checkpoint_space.remove_stale_temporaries(root)
    needed = checkpoint_space.require_space(root, step, parts, with_optimizer, keep_last)
    faults.maybe_fill_disk(step, root)
    try:
        _write(root, tmp, final, step, parts, trainer_state, meta, keep_last, with_optimizer)
    except BaseException as err:
        if not checkpoint_space.failed_for_space(err, root, tmp, needed):
            raise
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise checkpoint_space.space_error(root, step, needed, None, keep_last) from None
    if _rank() == 0:
        log.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - start)
    _barrier()
    return final


def _write(root: str, tmp: str, final: str, step: int, parts: dict[str, ModelPart], trainer_state: Optional[dict],
           meta: Optional[dict], keep_last: int, with_optimizer: bool) -> None:
    """Write the checkpoint into ``tmp``, then rename it to ``final`` and point ``latest`` at it."""
    from megatron.core import dist_checkpointing

    if _rank() == 0:
        os.makedirs(os.path.join(tmp, "rng"))
        for name in parts:
            os.makedirs(os.path.join(tmp, name))
    _barrier()
    for name, part in parts.items():
        dist_checkpointing.save(_part_sharded(part, with_optimizer), os.path.join(tmp, name),
                                sharded_strategy=_save_strategy())
    torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{_rank():05d}.pt"))
    if _rank() == 0 and trainer_state is not None:
        torch.save(trainer_state, os.path.join(tmp, "trainer_state.pt"))
    if _rank() == 0:
        _copy_companions(tmp, meta or {})
    _barrier()
    sizes = _file_sizes(tmp)
    sums = _checksums(tmp, sorted(sizes))
    if _rank() == 0:
        info = dict(meta or {})
        info.update(format=FORMAT_VERSION, step=step, parts=sorted(parts), with_optimizer=with_optimizer,
                    world_size=dist.get_world_size() if dist.is_initialized() else 1, complete=True,
                    files=sizes, checksums=sums)
        _write_json(os.path.join(tmp, "meta.json"), info)
        _fsync_dir(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        with open(os.path.join(root, "latest.tmp"), "w") as fh:
            fh.write(step_dir_name(step) + "\n")
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        if keep_last > 0:
            _prune(root, keep_last)


def _copy_companions(tmp: str, meta: dict) -> None:
    """Copy the tokenizer files and ``generation_config.json`` of the model the run used (the
    ``source`` and ``tokenizer`` directories ``meta`` records, from this run's own config) into the
    checkpoint's :data:`COMPANIONS_DIR`: exports and generation read them from there, so a
    checkpoint never makes a command open a directory its ``meta.json`` names."""
    source, tokenizer = meta.get("source"), meta.get("tokenizer")
    if not (source or tokenizer):
        return
    from megatron_rl.models.hf_bridge import copy_companion_files

    target = os.path.join(tmp, COMPANIONS_DIR)
    os.makedirs(target)  # kept when empty: the model has neither, which is what a reader then finds
    copy_companion_files(target, source, tokenizer or source)


def companions_dir(path: str) -> Optional[str]:
    """The directory of tokenizer files and ``generation_config.json`` the checkpoint at ``path``
    carries, or None (a model without them, or a checkpoint saved before they were copied)."""
    target = os.path.join(path, COMPANIONS_DIR)
    return target if os.path.isdir(target) and not os.path.islink(target) else None


def _prune(root: str, keep_last: int) -> None:
    steps = sorted(d for d in os.listdir(root) if _STEP_DIR.match(d))
    for name in steps[:-keep_last]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _read_manifest(path: str) -> Any:
    """The parsed ``meta.json`` of ``path``, read without following a link; CheckpointError for
    anything that is not a JSON file (a link, a directory, deep nesting, bad bytes)."""
    meta_path = os.path.join(path, MANIFEST)
    try:
        info = os.lstat(meta_path)
    except FileNotFoundError:
        if not _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
            raise CheckpointError("checkpoint", path, f"not a checkpoint (no {MANIFEST} here)",
                                  "give a step_XXXXXXXX directory, a run's checkpoints/ directory or the run "
                                  "directory") from None
        raise CheckpointError("checkpoint", path, f"{MANIFEST} is missing (the save did not finish)",
                              _EARLIER) from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError("checkpoint", path, f"{MANIFEST} is a symbolic link (links in a checkpoint are "
                              "never followed)", f"replace it with the file itself, or {_EARLIER}")
    if not stat.S_ISREG(info.st_mode) or info.st_size > MANIFEST_MAX_BYTES:
        raise CheckpointError("checkpoint", path, f"{MANIFEST} is corrupt (not a manifest file)", _EARLIER)
    try:
        fd = os.open(meta_path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            return json.loads(fh.read(MANIFEST_MAX_BYTES + 1))
    except RecursionError:  # json's parser recurses once per nesting level
        raise CheckpointError("checkpoint", path, f"{MANIFEST} is corrupt (nested too deep)", _EARLIER) from None
    except (ValueError, OSError) as err:
        why = "not JSON" if isinstance(err, ValueError) else err.strerror
        raise CheckpointError("checkpoint", path, f"{MANIFEST} is corrupt ({why})", _EARLIER) from None


def _json_text(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(value: Any, least: int) -> bool:
    return type(value) is int and value >= least


def _manifest_problem(meta: dict) -> Optional[str]:
    """What makes ``meta`` (a dict) something other than the manifest :func:`save_checkpoint`
    writes, naming the key; None when it is one.  Every reader of a checkpoint relies on these
    types, so a crafted manifest stops here as a bad checkpoint rather than as an exception deep
    in a rank."""
    from megatron_rl.config.model_io import model_dict_problem

    if not _whole(meta.get("step"), 0):
        return f'"step" is {_json_text(meta.get("step"))}, expected a whole number >= 0'
    parts = meta.get("parts")
    if not isinstance(parts, list) or not all(isinstance(p, str) and _PART_NAME.match(p) for p in parts) \
            or len(set(parts)) != len(parts):
        return f'"parts" is {_json_text(parts)}, expected a list of distinct part names like ["actor"]'
    files = meta.get("files")
    if not isinstance(files, dict) or not all(_whole(size, 0) for size in files.values()):
        return f'"files" is {_json_text(files)}, expected {{"<file>": <size in bytes>, ...}}'
    sums = meta.get("checksums")
    if sums is None:
        return f"it lists no {CHECKSUM} checksums (written before checksums existed, or not by this project)"
    if not isinstance(sums, dict) or not all(isinstance(v, str) and _SHA256.match(v) for v in sums.values()):
        return f'"checksums" is {_json_text(sums)}, expected {{"<file>": "<{CHECKSUM} hex>", ...}}'
    unsummed = sorted(set(files) ^ set(sums))
    if unsummed:
        where = '"checksums"' if unsummed[0] in files else '"files"'
        return f"file {unsummed[0]} has no entry in {where} (every file needs its size and {CHECKSUM})"
    if "with_optimizer" in meta and type(meta["with_optimizer"]) is not bool:
        return f'"with_optimizer" is {_json_text(meta["with_optimizer"])}, expected true or false'
    if "world_size" in meta and not _whole(meta["world_size"], 1):
        return f'"world_size" is {_json_text(meta["world_size"])}, expected a whole number >= 1'
    for key in ("source", "tokenizer"):
        if key in meta and not isinstance(meta[key], str):
            return f'"{key}" is {_json_text(meta[key])}, expected a string'
    vocabulary = meta.get("vocabulary")
    if "vocabulary" in meta and not (isinstance(vocabulary, dict) and _whole(vocabulary.get("size"), 1)
                                     and isinstance(vocabulary.get("sha256"), str)
                                     and _SHA256.match(vocabulary["sha256"])):
        return f'"vocabulary" is {_json_text(vocabulary)}, expected {{"size": <tokens>, "sha256": "<hex>"}}'
    if "hf_config" in meta and not isinstance(meta["hf_config"], dict):
        return f'"hf_config" is {_json_text(meta["hf_config"])}, expected an object'
    models = meta.get("models", {})
    if not isinstance(models, dict):
        return f'"models" is {_json_text(models)}, expected {{"<part>": {{<model settings>}}, ...}}'
    for name, config in models.items():
        problem = model_dict_problem(config)
        if problem:
            return f'"models.{name[:40]}": {problem}'
    return None


def _scan_files(path: str) -> dict[str, int]:
    """``{relative name: size}`` of every file under ``path`` but ``meta.json``, without following
    links: a link (to a file or a directory, inside or outside) or a special file is refused with
    CheckpointError, so nothing outside the step directory is ever read as part of it."""
    found: dict[str, int] = {}
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            with os.scandir(os.path.join(path, rel_dir)) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError as err:
            raise CheckpointError("checkpoint", path, f"cannot list {rel_dir or '.'} ({err.strerror})",
                                  _EARLIER) from None
        for entry in entries:
            rel = os.path.join(rel_dir, entry.name)
            if entry.is_symlink():
                target = os.readlink(entry.path)
                raise CheckpointError("checkpoint", path, f"{rel} is a symbolic link (to {target}); links in a "
                                      "checkpoint are never followed",
                                      f"copy the checkpoint with its files (cp -rL), or {_EARLIER}")
            if entry.is_dir(follow_symlinks=False):
                pending.append(rel)
            elif entry.is_file(follow_symlinks=False):
                found[rel] = entry.stat(follow_symlinks=False).st_size
            else:
                raise CheckpointError("checkpoint", path, f"{rel} is not a regular file", _EARLIER)
    found.pop(MANIFEST, None)
    return found


def check_checkpoint(path: str) -> dict:
    """Return meta.json of a complete checkpoint, or raise CheckpointError saying what is wrong:
    a manifest of another shape, a listed file missing or of another size, a file it does not
    list, a link.  Reads the manifest and the directory listing only (no file contents)."""
    if not os.path.isdir(path):
        raise CheckpointError("checkpoint", path, "no such directory", "give the path of a step_XXXXXXXX directory")
    meta = _read_manifest(path)
    if not isinstance(meta, dict):
        raise CheckpointError("checkpoint", path, f"{MANIFEST} is corrupt (it holds {_json_text(meta)[:20]}, not a "
                              "manifest object)", _EARLIER)
    if meta.get("complete") is not True or type(meta.get("format")) is not int or meta["format"] != FORMAT_VERSION:
        raise CheckpointError("checkpoint", path, f"incomplete or unknown format {_json_text(meta.get('format'))}",
                              _EARLIER)
    problem = _manifest_problem(meta)
    if problem:
        raise CheckpointError("checkpoint", path, f"{MANIFEST} is corrupt: {problem}", _EARLIER)
    found = _scan_files(path)
    for rel, size in meta["files"].items():
        if rel not in found:
            raise CheckpointError("checkpoint", path, f"file {rel} is missing", _EARLIER)
        if found[rel] != size:
            raise CheckpointError("checkpoint", path, f"file {rel} is truncated or altered "
                                  f"({found[rel]} bytes, {size} written)", _EARLIER)
    unlisted = sorted(set(found) - set(meta["files"]))
    if unlisted:
        raise CheckpointError("checkpoint", path, f"file {unlisted[0]} is not listed in {MANIFEST} "
                              f"({len(unlisted)} unlisted file(s); a checkpoint loads only the files it lists)",
                              f"remove it if you put it there, else {_EARLIER}")
    for name in meta["parts"]:
        if f"{name}/metadata.json" not in found:
            raise CheckpointError("checkpoint", path, f"part {name!r} has no metadata.json", _EARLIER)
        if not any(rel.startswith(f"{name}/") and rel.endswith(".distcp") for rel in found):
            raise CheckpointError("checkpoint", path, f"part {name!r} has no tensor files", _EARLIER)
    return meta


# The model settings that decide the shapes of the saved tensors.
ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "vocab_size", "activation", "normalization", "add_qkv_bias", "add_bias_linear",
                     "qk_layernorm", "tie_word_embeddings", "moe.num_experts", "moe.ffn_hidden_size",
                     "moe.shared_expert_ffn_hidden_size")


def _lookup(config: dict, dotted: str):
    value = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def check_same_architecture(path: str, saved: Optional[dict], current: dict, part: str) -> None:
    """:class:`CheckpointError` naming the first setting whose value differs between the model the
    checkpoint holds and the one this run builds (instead of a shape error inside the loader)."""
    if not saved:
        return
    for key in ARCHITECTURE_KEYS:
        was, now = _lookup(saved, key), _lookup(current, key)
        if was != now and not (key == "kv_channels" and None in (was, now)):
            raise CheckpointError(f"model.{key}", now, f"the checkpoint's {part} was saved with model.{key}={was} "
                                  f"({path})", f"set model.{key}={was} to load it, or start a new run "
                                  "(run.name=<new name>)")


def list_checkpoints(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root)) if _STEP_DIR.match(d)]


def find_latest(root: str, warn: bool = True) -> Optional[str]:
    """Newest checkpoint under ``root`` that passes :func:`check_checkpoint` (warns about others,
    unless ``warn`` is False: a probe whose caller's own load reports them)."""
    for path in reversed(list_checkpoints(root)):
        try:
            check_checkpoint(path)
            return path
        except CheckpointError as err:
            if warn:
                log.warning("skipping %s: %s", path, err)
    return None


def resolve_checkpoint(path: str, key: str = "--checkpoint") -> str:
    """The step directory a tool should read for ``path``: ``path`` itself when it is one, else the
    newest complete checkpoint under it, read as a run's ``checkpoints/`` directory or as the run
    directory (``runs/<name>/``).  A path that is none of these comes back as it is, for
    :func:`check_checkpoint` to say what is wrong with it."""
    if os.path.isfile(os.path.join(path, "meta.json")) or _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        if list_checkpoints(root):
            latest = find_latest(root)
            if latest is None:
                raise CheckpointError(key, path, f"none of the checkpoints under {root} is complete",
                                      "give a step_XXXXXXXX directory whose save finished (it has meta.json)")
            return latest
    return path


def load_newest(candidates: list[str], parts: dict[str, ModelPart], model_config: Optional[dict], *,
                fall_back: bool, log, base: Optional[dict] = None) -> Optional[tuple[str, dict, dict]]:
    """Load the first of ``candidates`` (newest first) that loads on every rank: ``(path, meta,
    trainer state)``, or None when there are none.  A collective.

    With ``fall_back`` (``trainer.resume=auto``) a checkpoint that does not load is skipped with a
    line through ``log``; a path the user gave, or a model setting no checkpoint of the run can
    match, stops with its :class:`CheckpointError`, as does a run whose every checkpoint fails.
    ``base``: the frozen base of a LoRA run (:mod:`megatron_rl.models.lora.base`), which each
    candidate's adapters must have been trained on."""
    first_error = None
    for candidate in candidates:
        err = None
        try:
            meta = load_checkpoint(candidate, parts, model_config=model_config, base=base)
            state = load_trainer_state(candidate) or {}
        except CheckpointError as raised:
            err = raised
        if not collectives.agree_any(err is not None):  # a rank's own file (rng) may fail alone
            if candidate != candidates[0]:
                log(f"checkpoint: resuming from {candidate}, the newest checkpoint that loads")
            return candidate, meta, state
        err = err or CheckpointError("checkpoint", candidate, "another rank could not read its files",
                                     "use an earlier checkpoint")
        if not fall_back or err.key.startswith("model."):
            raise err
        first_error = first_error or err
        log(f"checkpoint: skipping {candidate}: {err.problem}")
    if first_error is not None:
        raise first_error
    return None


def load_checkpoint(
    path: str,
    parts: dict[str, ModelPart],
    *,
    with_optimizer: bool = True,
    load_rng: bool = True,
    model_config: Optional[dict] = None,
    base: Optional[dict] = None,
) -> dict:
    """Load ``parts`` from ``path`` into whatever layout they are built on; returns the meta.

    Every file is checked against its checksum first; ``model_config`` (the run's
    ``model_config_to_dict``) is compared with the architecture each part was saved with."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # 2 s to import: not at launch

    safe_unpickling.install()
    weights_only_common.install()
    meta = check_checkpoint(path)
    verify_contents(path, meta)
    if model_config is not None:
        for name in parts:
            check_same_architecture(path, meta.get("models", {}).get(name), model_config, name)
    check_lora_base(path, meta, base)
    for name, part in parts.items():
        if name not in meta["parts"]:
            raise CheckpointError("checkpoint", path, f"has no part {name!r} (it has {meta['parts']})",
                                  "load a checkpoint written by the same kind of run")
        want_opt = with_optimizer and meta.get("with_optimizer", True)
        metadata = os.path.join(path, name, ".metadata")
        try:
            if os.path.isfile(metadata):
                safe_unpickling.check_metadata_file(metadata)
        except UnsafeCheckpointFile as err:
            raise CheckpointError("checkpoint", path, f"{name}/.metadata was refused: {err}", REFUSED_FIX) from None
        except (pickle.UnpicklingError, EOFError, ValueError, OSError) as err:
            raise CheckpointError("checkpoint", path, f"{name}/.metadata is corrupt ({type(err).__name__})",
                                  "use an earlier checkpoint") from None
        request = _part_sharded(part, want_opt, loading=True)
        try:
            loaded = dist_checkpointing.load(request, os.path.join(path, name))
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - any unreadable part is a bad checkpoint
            unsafe = _unsafe_cause(err)
            if unsafe is not None:
                raise CheckpointError("checkpoint", path, f"part {name!r} was refused: {unsafe}", REFUSED_FIX) from None
            raise CheckpointError("checkpoint", path, f"part {name!r} could not be read ({type(err).__name__}: "
                                  f"{(str(err).splitlines() or [''])[0][:200]})", "use an earlier checkpoint") from None
        keys = ["model"] if len(part.chunks) == 1 else [f"model{i}" for i in range(len(part.chunks))]
        for key, chunk in zip(keys, part.chunks):
            # A part of some tensors only (LoRA) names all it asked for; dist_checkpointing refuses a
            # checkpoint missing any of them.
            _inner(chunk).load_state_dict(loaded[key], strict=part.only is None)
        if want_opt and part.optimizer is not None:
            part.optimizer.load_state_dict(loaded["optimizer"])
        if want_opt and part.scheduler is not None:
            part.scheduler.load_state_dict(loaded["scheduler"])
    if load_rng:
        rng_path = os.path.join(path, "rng", f"rank_{_rank():05d}.pt")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if os.path.isfile(rng_path) and meta.get("world_size") == world:
            set_rng_state(load_plain(rng_path, path))
    return meta


def load_trainer_state(path: str) -> Optional[dict]:
    state_path = os.path.join(path, "trainer_state.pt")
    if not os.path.isfile(state_path):
        return None
    return load_plain(state_path, path)


# numpy's array reconstruction, for RNG files written before the numpy state was stored as a list.
_NUMPY_ARRAY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def load_plain(file: str, checkpoint: str) -> Any:
    """``torch.load(weights_only=True)`` of one of our own checkpoint files (tensors, containers,
    numbers, numpy arrays): a file that names anything else is refused, never run."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as err:
        first = (str(err).splitlines() or [""])[0]
        refused = "Unsupported global" in str(err) or "Weights only load failed" in first
        problem = (f"{os.path.relpath(file, checkpoint)} asks to load code or classes a checkpoint may not hold"
                   if refused else f"{os.path.relpath(file, checkpoint)} is corrupt ({first[:160]})")
        fix = REFUSED_FIX if refused else "use an earlier checkpoint"
        raise CheckpointError("checkpoint", checkpoint, problem, fix) from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        raise CheckpointError("checkpoint", checkpoint, f"{os.path.relpath(file, checkpoint)} is corrupt "
                              f"({type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]})",
                              "use an earlier checkpoint") from None


def _unsafe_cause(err: BaseException) -> Optional[UnsafeCheckpointFile]:
    """The :class:`UnsafeCheckpointFile` behind ``err`` (torch wraps per-rank failures in a
    ``CheckpointException`` that lists them), if any."""
    seen = set()
    stack = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UnsafeCheckpointFile):
            return e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [f for f in failures.values() if isinstance(f, BaseException)]
            stack += [getattr(f, "exception", None) for f in failures.values()]
    return None
