"""Writing the run's own files (metrics, sample logs, the plot, TensorBoard, config.yaml) so that a
full disk ends the job the way a checkpoint that does not fit does: one line naming the file, what
it needed and what was free, exit 2 -- and nothing left half-written.

A whole file is written to ``<path>.tmp`` and renamed over ``path``: a failed write removes the
temporary, so the file is the old one or the new one, never a part.  An appended line (a step's
metrics) is written whole or the file is cut back to its length before the write: a resumed run
reads every line of it.  Temporaries a killed job left behind are removed at start-up
(:func:`remove_run_temporaries`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
from typing import Callable, Iterable, Iterator

from megatron_rl.errors import StorageError

# The errors a write gives when the disk (or the user's quota, or the file-size limit) is full.
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
TEMPORARY = ".tmp"
KIB = 1 << 10
SPACE_FIX = ("free space on that disk, or set run.dir to a directory with space; trainer.resume=auto goes on from "
             "the last checkpoint")


def _free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".").free
    except OSError:
        return None


def _kib(n: int) -> str:
    return f"{max(1, -(-n // KIB)):,} KiB"


def storage_error(path: str, what: str, needed: int | None, err: OSError) -> StorageError:
    """The one line for a write of ``what`` to ``path`` that failed with ``err``."""
    if err.errno in SPACE_ERRNOS:
        free = _free_bytes(path)
        need = f"needs {_kib(needed)}" if needed is not None else "needs more space"
        have = f", {_kib(free)} free" if free is not None else ""
        return StorageError(path, None, f"the disk is full: writing {what} {need}{have}", SPACE_FIX)
    return StorageError(path, None, f"cannot write {what}: {err.strerror or err}",
                        "make the directory writable, or set run.dir to one that is")


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def replace_file(path: str, what: str, write: Callable[[str], None], needed: int | None = None) -> None:
    """``write(tmp)`` makes the new file at ``tmp``; it then replaces ``path`` in one rename.
    ``needed``: the file's size where it is known before writing (else what got written)."""
    tmp = path + TEMPORARY
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as err:
        if needed is None and os.path.exists(tmp):
            needed = os.path.getsize(tmp)
        _remove(tmp)
        raise storage_error(path, what, needed, err) from None


def replace_text(path: str, text: str, what: str) -> None:
    """``path`` now holds ``text``, or (on any failure) what it held before."""
    data = text.encode("utf-8")

    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)

    replace_file(path, what, write, needed=len(data))


def append_text(path: str, text: str, what: str) -> None:
    """Append ``text`` whole, or leave ``path`` as it was."""
    data = text.encode("utf-8")
    try:
        before = os.path.getsize(path)
    except OSError:
        before = None
    try:
        with open(path, "ab") as fh:
            fh.write(data)
    except OSError as err:
        with contextlib.suppress(OSError):
            if before is None:
                os.remove(path)
            else:
                os.truncate(path, before)  # cutting a file back frees space: always possible
        raise storage_error(path, what, len(data), err) from None


@contextlib.contextmanager
def writing(path: str, what: str) -> Iterator[None]:
    """Around a library's writer (TensorBoard, matplotlib): its OSError becomes the one line."""
    try:
        yield
    except OSError as err:
        raise storage_error(path, what, None, err) from None


def remove_run_temporaries(run_dir: str) -> list[str]:
    """The ``.tmp`` files a killed job left in the run directory (not the checkpoints': see
    :mod:`megatron_rl.engine.checkpoint_space`); returns what was removed."""
    found = glob.glob(os.path.join(glob.escape(run_dir), "*" + TEMPORARY))
    found += glob.glob(os.path.join(glob.escape(run_dir), "samples", "*" + TEMPORARY))
    for path in found:
        _remove(path)
    return found


def save_config(cfg, path: str, notes: Iterable[str] = ()) -> None:
    """The run's ``config.yaml`` (:func:`megatron_rl.config.loader.config_text`), written whole or not at all."""
    from megatron_rl.config.loader import config_text

    replace_text(path, config_text(cfg, notes), "the run's config")
