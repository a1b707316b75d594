"""A full disk loses nothing and blocks nothing: a checkpoint that does not fit stops the job with
one line naming the directory and the space needed (checked before writing; and when the disk
fills during the write), no partial checkpoint is left, the last good checkpoint resumes once
there is space, and the temporaries of an earlier failed save never stop a new run.

Each case runs the real CLI on a small tmpfs mounted in a private mount namespace
(``unshare -rm``), so the disk is really full (ENOSPC from the kernel)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from tests.support.helpers import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow
RUN = [*TINY, "parallel.tp=2", "trainer.save_every=2", "distributed.timeout_s=60"]


def _can_mount_tmpfs(where) -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """``run(size, script)``: ``script`` (sh) in a mount namespace with a tmpfs of ``size`` at
    ``$DISK``; ``$TRAIN`` is the 2-rank CLI command, ``$TRAIN1`` the same run on one process (append
    overrides)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        can = _can_mount_tmpfs(disk)
    except FileNotFoundError:
        can = False
    if not can:
        pytest.skip("needs unshare -rm and tmpfs mounts (a private mount namespace) to fill a real disk")
    train = shlex.join([sys.executable, "-m", "megatron_rl.tools.cli", "train", "--nproc", "2", *RUN,
                        f"run.dir={disk}", "run.name=r"])
    train1 = shlex.join([sys.executable, "-m", "megatron_rl.tools.cli", "train", "--nproc", "1", *RUN,
                         "parallel.tp=1", f"run.dir={disk}", "run.name=r"])
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT"}

    def run(size: str, script: str) -> None:
        body = f"set -u; mount -t tmpfs -o size={size} tmpfs {disk} && cd {shlex.quote(ROOT)} && {script}"
        subprocess.run(["unshare", "-rm", "sh", "-c", body],
                       env={**env, "DISK": str(disk), "TRAIN": train, "TRAIN1": train1}, timeout=600, check=True)

    return tmp_path, run


def _job(tmp_path, name: str) -> tuple[int, str]:
    with open(tmp_path / f"{name}.rc") as fh:
        code = int(fh.read())
    with open(tmp_path / f"{name}.err") as fh:
        return code, fh.read()


def _launch(tmp_path, name: str, extra: str = "", env: str = "", train: str = "$TRAIN") -> str:
    """sh: run the job, keep its exit code and stderr, and list the checkpoints it left."""
    return (f"{env} {train} {extra} > {tmp_path}/{name}.out 2> {tmp_path}/{name}.err; echo $? > {tmp_path}/{name}.rc; "
            f"ls $DISK/r/checkpoints > {tmp_path}/{name}.ls 2>/dev/null; true")


def _listing(tmp_path, name: str) -> list[str]:
    with open(tmp_path / f"{name}.ls") as fh:
        return fh.read().split()


def _storage_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("storage error:")]
    assert lines, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


def test_a_checkpoint_that_does_not_fit_stops_before_writing_with_one_line(small_disk):
    tmp_path, run = small_disk
    run("700k", _launch(tmp_path, "job", "trainer.steps=1"))  # the last step's save is the first
    code, err = _job(tmp_path, "job")
    line = _storage_line(err)
    assert code == 2
    assert f"{tmp_path}/disk/r/checkpoints" in line and "needs about" in line and "MiB free" in line, line
    assert _listing(tmp_path, "job") == []  # nothing partial


def test_a_disk_that_fills_during_the_save_keeps_the_last_checkpoint_and_resumes(small_disk):
    """Another writer takes the disk after the space check (fault ``fill_disk``): the step-4 save
    fails with one line, leaves no partial checkpoint, and once the space is back the same command
    resumes from step 2 and finishes."""
    tmp_path, run = small_disk
    run("6m", _launch(tmp_path, "full", "trainer.steps=4", env="MEGATRON_RL_FAULT=fill_disk@rank=0:step=4")
        + " ; rm $DISK/r/disk_filler; " + _launch(tmp_path, "again", "trainer.steps=4"))
    code, err = _job(tmp_path, "full")
    line = _storage_line(err)
    assert code == 2 and "the disk is full" in line and "step 4 checkpoint" in line, line
    assert _listing(tmp_path, "full") == ["latest", "step_00000002"]
    code, err = _job(tmp_path, "again")
    assert code == 0, err[-3000:]
    with open(tmp_path / "again.out") as fh:
        out = fh.read()
    assert "resum" in out and "step_00000002" in out, out[-2000:]
    assert _listing(tmp_path, "again") == ["latest", "step_00000002", "step_00000004"]


def test_temporaries_of_a_failed_save_never_block_the_next_run(small_disk):
    """A stale ``step_*.tmp`` that holds the whole disk and a 0-byte ``config.yaml.tmp``, as a
    save killed by a full disk leaves them: the next run removes them and trains.  The launcher
    removes them before any rank starts, so one process is enough."""
    tmp_path, run = small_disk
    stale = "$DISK/r/checkpoints/step_00000003.tmp"
    run("3m", f"mkdir -p {stale}/actor && : > $DISK/r/config.yaml.tmp && "
        f"(dd if=/dev/zero of={stale}/actor/__0_0.distcp bs=64k 2>/dev/null; true) && "
        + _launch(tmp_path, "job", "trainer.steps=2", train="$TRAIN1"))
    code, err = _job(tmp_path, "job")
    assert code == 0, err[-3000:]
    assert _listing(tmp_path, "job") == ["latest", "step_00000002"]


WRITERS = {  # the fault's phase -> the file whose write finds the disk full
    "metrics": "metrics.jsonl",
    "samples": "samples/step_00000003.jsonl",
    "tensorboard": "tb",
    "plot": "plot.png",
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_disk_that_fills_outside_a_save_stops_each_writer_with_one_line(small_disk, writer):
    """Another writer takes the disk after step 2's checkpoint; the run's next write of its own
    (the metrics line, the sample log, TensorBoard's events, the plot) stops the job with one line
    naming the file and what it needed, exit 2: no traceback, no ``.tmp``, no half-written line,
    step 2's checkpoint intact; with the space back, the same command goes on from there.

    Only rank 0 writes these files, so one writer (the metrics line, written while the other rank is
    mid-step) runs as a 2-rank job, through the launcher that stops the other rank; the others run on
    one process (one process per job instead of a launcher and two ranks)."""
    tmp_path, run = small_disk
    extra = "trainer.steps=3 trainer.log_samples=true trainer.tensorboard=true trainer.plot=true"
    train = "$TRAIN" if writer == "metrics" else "$TRAIN1"
    run("8m", _launch(tmp_path, "full", extra, env=f"MEGATRON_RL_FAULT=fill_disk@rank=0:step=3:phase={writer}",
                      train=train)
        + f" ; find $DISK/r -name '*.tmp' > {tmp_path}/tmp.ls; cp $DISK/r/metrics.jsonl {tmp_path}/metrics.jsonl"
        + " ; rm $DISK/r/disk_filler; " + _launch(tmp_path, "again", extra, train=train))
    code, err = _job(tmp_path, "full")
    line = _storage_line(err)
    assert code == 2, err[-3000:]
    assert line.startswith(f"storage error: {tmp_path}/disk/r/{WRITERS[writer]}"), line
    assert "the disk is full:" in line and " free; fix: free space on that disk" in line, line
    if writer != "tensorboard":  # TensorBoard's writer does not say how much it was writing
        assert "needs " in line and " KiB" in line, line
    assert (tmp_path / "tmp.ls").read_text() == ""
    import json

    steps = [json.loads(row)["step"] for row in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == ([1, 2] if writer in ("metrics", "samples") else [1, 2, 3])
    assert "step_00000002" in _listing(tmp_path, "full")
    code, err = _job(tmp_path, "again")
    assert code == 0, err[-3000:]
    out = (tmp_path / "again.out").read_text()
    if "step_00000003" in _listing(tmp_path, "full"):  # the plot: written after the last checkpoint
        assert "run finished: step 3" in out, out[-2000:]
    else:
        assert "resumed after step 2" in out, out[-2000:]
    assert _listing(tmp_path, "again")[-1] == "step_00000003"


def test_a_disk_full_before_the_job_starts_stops_at_its_config_with_one_line(small_disk):
    """The first thing a run writes is its config.yaml: on a full disk the launcher stops there, before
    any rank starts, with one line saying what the file needs and what is free, and leaves no
    ``config.yaml.tmp``."""
    tmp_path, run = small_disk
    run("1m", "mkdir -p $DISK/r && (dd if=/dev/zero of=$DISK/filler bs=4k 2>/dev/null; true) && "
        + _launch(tmp_path, "job", "trainer.steps=1") + f" ; ls -a $DISK/r > {tmp_path}/r.ls")
    code, err = _job(tmp_path, "job")
    line = _storage_line(err)
    assert code == 2
    assert line.startswith(f"storage error: {tmp_path}/disk/r/config.yaml: the disk is full: writing the run's "
                           "config needs "), line
    assert " KiB free; fix: free space on that disk" in line, line
    assert (tmp_path / "r.ls").read_text().split() == [".", ".."]
