"""Stopping a job never loses work and never leaves anything running: SIGTERM after a periodic
save, Ctrl-C with one process (once: checkpoint and exit 0; twice: abort), kill -9 of a rank (its
helpers do not outlive the job or hold its output open), kill -9 of the launcher (the ranks stop);
a stop, or a second Ctrl-C, during the evaluation and during the SFT warm-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.helpers import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow
LONG = [*TINY, "trainer.steps=400", "distributed.timeout_s=60"]


def start(tmp_path, nproc: int, *overrides: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT"}
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.tools.cli", "train", "--nproc", str(nproc), *LONG,
                             f"run.dir={tmp_path}", "run.name=r", *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def steps_done(tmp_path) -> int:
    try:
        with open(tmp_path / "r" / "metrics.jsonl") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def wait_for_step(proc, tmp_path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(tmp_path) < step:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no step {step} after {timeout} s")
        time.sleep(0.05)


def finish(proc, timeout: float = 180) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)  # returns only once every holder of the pipes closed them
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def checkpoints(tmp_path) -> list[str]:
    root = tmp_path / "r" / "checkpoints"
    return sorted(os.listdir(root)) if root.is_dir() else []


def last_metrics_step(tmp_path) -> int:
    with open(tmp_path / "r" / "metrics.jsonl") as fh:
        return json.loads([line for line in fh if line.strip()][-1])["step"]


def processes() -> dict[int, list[str]]:
    """``pid -> /proc/<pid>/stat`` fields after the command name (state, ppid, pgrp, ...)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    out[int(entry)] = fh.read().split(")")[-1].split()
            except OSError:
                pass
    return out


def alive(pid: int) -> bool:
    fields = processes().get(pid)
    return fields is not None and fields[0] != "Z"


def rank_pids(launcher_pid: int) -> list[int]:
    """The launcher's children (the ranks)."""
    return sorted(pid for pid, fields in processes().items() if int(fields[1]) == launcher_pid)


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    return [pid for pid, fields in processes().items() if int(fields[2]) == pgid and fields[0] != "Z"]


def test_sigterm_after_a_periodic_save_checkpoints_and_exits_0(tmp_path):
    """Used to end in BrokenPipeError, exit 1, a step_*.tmp left: the launcher signalled each rank's
    whole process group, megatron's checkpoint-writer processes included."""
    proc = start(tmp_path, 2, "trainer.save_every=3")
    wait_for_step(proc, tmp_path, 5)
    proc.send_signal(signal.SIGTERM)
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    step = last_metrics_step(tmp_path)
    assert step >= 5 and f"step_{step:08d}" in checkpoints(tmp_path), (step, checkpoints(tmp_path))
    assert not any(name.endswith(".tmp") for name in checkpoints(tmp_path))
    assert f"checkpoint after step {step}" in out + err


def test_ctrl_c_once_checkpoints_and_twice_aborts_with_one_process(tmp_path):
    proc = start(tmp_path, 1)
    wait_for_step(proc, tmp_path, 2)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "Ctrl-C: stopping after this step with a checkpoint" in err
    step = last_metrics_step(tmp_path)
    assert f"step_{step:08d}" in checkpoints(tmp_path)

    again = tmp_path / "again"
    proc = start(again, 1)
    wait_for_step(proc, again, 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert "aborted" in err.splitlines()[-1]


def test_kill_9_of_a_rank_ends_the_job_and_leaves_no_helper_holding_its_output(tmp_path):
    proc = start(tmp_path, 2, "trainer.save_every=1")
    wait_for_step(proc, tmp_path, 3)
    rank0 = rank_pids(proc.pid)[0]
    os.kill(rank0, signal.SIGKILL)
    start_wait = time.monotonic()
    out, err = finish(proc, timeout=120)
    print(f"job ended {time.monotonic() - start_wait:.1f} s after kill -9 of rank 0")
    assert proc.returncode != 0 and "rank 0 died (signal 9)" in err, err[-2000:]
    assert group_members(rank0) == [], "helpers of the killed rank outlived the job"


def test_kill_9_of_the_launcher_stops_the_ranks(tmp_path):
    proc = start(tmp_path, 2)
    wait_for_step(proc, tmp_path, 2)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 120
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in ranks if alive(pid)]
    for pid in survivors:
        os.killpg(pid, signal.SIGKILL)
    assert not survivors, "ranks kept training after their launcher was killed"
    # They stopped the way SIGTERM stops them: a checkpoint of the last step.
    assert f"step_{last_metrics_step(tmp_path):08d}" in checkpoints(tmp_path)


EVAL_EACH_STEP = ["data.val_path=task:digit_sum", "eval.max_prompts=4", "trainer.eval_every=1"]
SFT = ["trainer.sft_warmup_steps=3"]


def _job(tmp_path, nproc: int, fault: str, *overrides: str):
    from tests.test_cli import cli

    return cli("train", "--nproc", str(nproc), *TINY, "trainer.steps=4", f"run.dir={tmp_path}", "run.name=r",
               *overrides, env={"MEGATRON_RL_FAULT": fault} if fault else None)[0]


@pytest.mark.parametrize("phase, nproc, fault, extra", [
    ("evaluation", 2, "sigterm@rank=1:step=2:phase=evaluation", EVAL_EACH_STEP),
    ("sft", 1, "sigterm@rank=0:step=2:phase=sft", SFT),
])
def test_sigterm_in_evaluation_or_sft_warm_up_checkpoints_and_exits_0(tmp_path, phase, nproc, fault, extra):
    """A stop asked during the evaluation after step 2 checkpoints step 2; during the SFT warm-up it
    checkpoints the warmed-up starting weights (step 0), so the resumed job does not warm up again."""
    stopped = _job(tmp_path, nproc, fault, *extra)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    if phase == "evaluation":
        assert "checkpoint after step 2" in stopped.stdout, stopped.stdout[-2000:]
        assert checkpoints(tmp_path)[-1] == "step_00000002"
    else:
        assert "sft warm-up 3/3" in stopped.stdout  # the warm-up finished: its weights are what is saved
        assert "signal 15: checkpoint of the starting weights (step 0)" in stopped.stdout, stopped.stdout[-2000:]
        assert checkpoints(tmp_path)[-1] == "step_00000000" and steps_done(tmp_path) == 0
    resumed = _job(tmp_path, nproc, "", *extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "sft warm-up" not in resumed.stdout
    assert checkpoints(tmp_path)[-1] == "step_00000004"


@pytest.mark.parametrize("phase, fault, extra", [
    ("evaluation", "ctrl_c_twice@rank=0:step=2:phase=evaluation", EVAL_EACH_STEP),
    ("sft", "ctrl_c_twice@rank=0:step=2:phase=sft", SFT),
])
def test_ctrl_c_twice_in_evaluation_or_sft_warm_up_aborts_without_a_checkpoint(tmp_path, phase, fault, extra):
    proc = _job(tmp_path, 1, fault, *extra)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "aborted (Ctrl-C twice); no checkpoint of the current step" in proc.stderr
    assert "step_00000002" not in checkpoints(tmp_path) and "step_00000000" not in checkpoints(tmp_path)
