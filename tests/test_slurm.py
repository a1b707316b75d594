"""scripts/slurm/ppo.sbatch on a real single-node Slurm started on localhost.

    pytest -m slow tests/test_slurm.py

The cluster (munged, slurmctld, slurmd) comes from :class:`tests.support.local_slurm.LocalSlurm`,
which installs Debian's slurm-wlm on first use; where that is impossible the tests skip with the
reason.  Jobs run the script exactly as users submit it: knobs in the environment, the repo's
virtualenv, torchrun under srun.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import time

import pytest

from tests.support.helpers import TINY, read_or_reason, started_or_skipped, venv_dir
from tests.support.local_slurm import TERMINAL_STATES, LocalSlurm, SlurmUnavailable, run_log_path

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "slurm", "ppo.sbatch")
JOB_TIMEOUT = 300


@pytest.fixture(scope="module")
def slurm():
    cluster = LocalSlurm()
    yield from started_or_skipped(cluster, cluster.start, cluster.stop, SlurmUnavailable, "no local Slurm")



def _knobs(run_dir, **extra) -> dict:
    knobs = dict(COMMAND="smoke", CONFIG="configs/smoke_cpu.yaml", NODES="1", NPROC_PER_NODE="4",
                 RUN_DIR=str(run_dir), RUN_NAME="smoke", VENV=venv_dir())
    knobs.update(extra)
    return knobs



def _job_output(tmp_path, job, run_name="smoke", restart=0) -> str:
    """The job's log in the run dir, plus Slurm's own output file, for assertion messages."""
    return (read_or_reason(run_log_path(os.path.join(tmp_path, run_name), job, restart))
            + "\n--- sbatch --output ---\n" + read_or_reason(os.path.join(tmp_path, f"slurm-{job}.out")))


def test_smoke_job_on_one_node_with_four_ranks(slurm, tmp_path):
    job = slurm.sbatch(SCRIPT, f"--output={tmp_path}/slurm-%j.out",
                       env=_knobs(tmp_path, OVERRIDES="smoke.steps=3"), cwd=REPO)
    state, code = slurm.wait(job, timeout=JOB_TIMEOUT)
    log = read_or_reason(run_log_path(os.path.join(tmp_path, "smoke"), job))
    assert (state, code) == ("COMPLETED", 0), _job_output(tmp_path, job)
    assert re.search(r"^step\s+3\s+loss\s+\d", log, re.M), log
    assert "4 proc(s), command=smoke" in log


@pytest.mark.parametrize("where", ["preflight", "ranks"])
def test_bad_override_fails_the_job_with_the_config_error(slurm, tmp_path, where):
    # preflight: the script's own check rejects it before srun (exit 2, one line);
    # ranks: with the check off, every rank rejects it and torchrun/srun carry the failure out.
    knobs = _knobs(tmp_path, OVERRIDES="parallel.tp=3", PREFLIGHT="1" if where == "preflight" else "0")
    job = slurm.sbatch(SCRIPT, f"--output={tmp_path}/slurm-%j.out", env=knobs, cwd=REPO)
    state, code = slurm.wait(job, timeout=JOB_TIMEOUT)
    log = read_or_reason(run_log_path(os.path.join(tmp_path, "smoke"), job))
    assert state == "FAILED" and code != 0, (state, code, _job_output(tmp_path, job))
    errors = [line for line in log.splitlines() if line.startswith("config error: parallel.tp=3:")]
    assert errors, log
    if where == "preflight":
        assert code == 2 and len(errors) == 1, log
        assert "step " not in log


# A stand-in for the trainer that follows the contract the script relies on: USR1 or TERM ->
# finish the current step, save a checkpoint, exit 0; trainer.resume=auto -> continue after it.
STUB_CLI = '''
import json, os, signal, sys, time

def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "validate":
        print("config OK")
        return 0
    kv = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))
    ckpt = os.path.join(kv["run.dir"], kv["run.name"], "ckpt.json")
    rank = int(os.environ["RANK"])
    stop = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda s, f: stop.append(s))
    done = 0
    if kv.get("trainer.resume") == "auto" and os.path.exists(ckpt):
        with open(ckpt) as fh:
            done = json.load(fh)["step"]
        if rank == 0:
            print(f"resumed after step {done}", flush=True)
    for step in range(done + 1, int(kv["stub.steps"]) + 1):
        time.sleep(0.3)
        if rank == 0:
            print(f"step {step}", flush=True)
            with open(ckpt + ".tmp", "w") as fh:
                json.dump({"step": step}, fh)
        if stop:
            if rank == 0:
                os.replace(ckpt + ".tmp", ckpt)
                print(f"signal {stop[0]}: checkpoint after step {step}", flush=True)
            return 0
    return 0

if __name__ == "__main__":
    sys.exit(main())
'''


def test_usr1_checkpoints_and_requeues_with_stub_trainer(slurm, tmp_path):
    """The script's half of preemption: USR1 to the batch shell reaches the workers (torchrun
    survives it), the job is requeued after they exit, and the next start resumes.  The requeue
    is not an end of the job: an `afterok` dependent waits for the restarted run's success."""
    stub = tmp_path / "stub"
    (stub / "megatron_rl" / "tools").mkdir(parents=True)
    (stub / "megatron_rl" / "__init__.py").write_text("")
    (stub / "megatron_rl" / "tools" / "__init__.py").write_text("")
    (stub / "megatron_rl" / "tools" / "cli.py").write_text(textwrap.dedent(STUB_CLI))
    knobs = _knobs(tmp_path, COMMAND="train", CONFIG="", NPROC_PER_NODE="2", RUN_NAME="stub",
                   OVERRIDES="stub.steps=15")
    # Submitted from the stub's directory: `python -m megatron_rl.tools.cli` finds the stub first.
    job = slurm.sbatch(SCRIPT, f"--output={tmp_path}/slurm-%j.out", env=knobs, cwd=str(stub))
    next_link = tmp_path / "next_link.sh"
    next_link.write_text("#!/bin/sh\ntrue\n")
    dependent = slurm.sbatch(str(next_link), f"--dependency=afterok:{job}",
                             f"--output={tmp_path}/slurm-%j.out", cwd=str(tmp_path))
    first = run_log_path(os.path.join(tmp_path, "stub"), job)
    slurm.wait_for_text(first, "step 3\n", timeout=JOB_TIMEOUT, job_id=job)
    slurm.scancel(job, signal="USR1", batch=True)  # what --signal=B:USR1 does at preemption
    slurm.wait_for_state(job, ["PENDING"], timeout=60)
    requeued = slurm.job_info(job)
    waiting = slurm.job_info(dependent)
    slurm.release(job)
    state, code = slurm.wait(job, timeout=JOB_TIMEOUT, restarts=1)
    second = run_log_path(os.path.join(tmp_path, "stub"), job, restart=1)
    logs = read_or_reason(first) + read_or_reason(second)
    assert (state, code) == ("COMPLETED", 0), (_job_output(tmp_path, job, "stub") + read_or_reason(second)
                                               + "\n" + slurm.daemon_logs())
    assert "requeue=1" in read_or_reason(first) and "signal 10: checkpoint after step" in read_or_reason(first), logs
    assert f"requeued: job {job} starts again as restart 1" in read_or_reason(first), logs
    assert "resumed after step" in read_or_reason(second), logs
    steps = [int(n) for n in re.findall(r"^step (\d+)$", logs, re.M)]
    assert steps == list(range(1, 16)), logs
    # Requeued, not ended: back in the queue with a restart counted and no failure recorded.
    assert (requeued["JobState"], requeued["Restarts"], requeued["ExitCode"]) == ("PENDING", "1", "0:0"), requeued
    assert (waiting["JobState"], waiting["Reason"]) == ("PENDING", "Dependency"), waiting
    assert slurm.wait(dependent, timeout=JOB_TIMEOUT) == ("COMPLETED", 0), slurm.job_info(dependent)
    assert slurm.job_info(dependent)["StartTime"] >= slurm.job_info(job)["EndTime"]


PPO_STEPS = 8
# One budget for the whole test, shared by its waits: two start-ups of torch + megatron in two
# ranks take ~15 s each on an idle 2-core machine but minutes when other jobs load it (a run at
# load ~140 needed 5 min for the first phase alone).  Only a hang ever waits this long.
PPO_BUDGET = 900


def test_preempted_ppo_job_resumes_from_checkpoint(slurm, tmp_path):
    """The whole preemption path with the real PPO trainer (tiny CPU model, 1 node x 2 gloo ranks):
    USR1 to the batch shell -> every rank checkpoints after the same step and exits 0 -> the
    script requeues -> the restart resumes (trainer.resume=auto, passed by the script) and
    finishes, with every step in metrics.jsonl exactly once.

    ``trainer.save_every=0``: the only checkpoint before the end is the one the signal asked
    for, so resuming after step N proves the signal path wrote it."""
    overrides = [*TINY, f"trainer.steps={PPO_STEPS}", "trainer.save_every=0",
                 "distributed.device=cpu", "distributed.backend=gloo"]
    knobs = _knobs(tmp_path, COMMAND="train", CONFIG="", NPROC_PER_NODE="2", RUN_NAME="ppo",
                   OVERRIDES=" ".join(overrides))
    run_dir = os.path.join(tmp_path, "ppo")
    job = slurm.sbatch(SCRIPT, f"--output={tmp_path}/slurm-%j.out", env=knobs, cwd=REPO)
    first, second = run_log_path(run_dir, job), run_log_path(run_dir, job, restart=1)

    def logs() -> str:
        return (_job_output(tmp_path, job, "ppo") + "\n--- restart 1 ---\n" + read_or_reason(second)
                + "\n--- metrics.jsonl ---\n" + read_or_reason(os.path.join(run_dir, "metrics.jsonl")))

    deadline = time.monotonic() + PPO_BUDGET

    def waiting(what, *args, **kwargs):
        try:
            return what(*args, timeout=max(1.0, deadline - time.monotonic()), **kwargs)
        except (TimeoutError, RuntimeError) as err:
            pytest.fail(f"{err}\n{logs()}")

    # MetricsWriter.progress on rank 0: "step    2/8 [#####---...]": the training loop (and with
    # it the trainer's signal handler) is running, and steps are left to be cut short.
    waiting(slurm.wait_for_text, first, f"step {2:>4}/{PPO_STEPS} ", job_id=job)
    slurm.scancel(job, signal="USR1", batch=True)  # what --signal=B:USR1 does at preemption
    # PENDING once requeued; a terminal state means it was not (fail now, not after the timeout).
    waiting(slurm.wait_for_state, job, ["PENDING", *TERMINAL_STATES])
    requeued = slurm.job_info(job)
    assert (requeued["JobState"], requeued["Restarts"], requeued["ExitCode"]) == ("PENDING", "1", "0:0"), \
        (requeued, logs())
    slurm.release(job)
    state, code = waiting(slurm.wait, job, restarts=1)
    assert (state, code) == ("COMPLETED", 0), logs() + "\n" + slurm.daemon_logs()

    # First run: "trainer.resume=auto" from the script, one checkpoint line (rank 0), exit 0, requeue.
    log1, log2 = read_or_reason(first), read_or_reason(second)
    assert "trainer.resume=auto" in log1, logs()
    stops = re.findall(r"^signal (?:10|on another rank): checkpoint after step (\d+) at (\S+); exiting$", log1, re.M)
    assert len(stops) == 1, logs()
    stop_step, stop_path = int(stops[0][0]), stops[0][1]
    assert 2 <= stop_step < PPO_STEPS, logs()
    assert stop_path == os.path.join(run_dir, "checkpoints", f"step_{stop_step:08d}"), logs()
    assert "training command exited with 0" in log1, logs()
    assert f"requeued: job {job} starts again as restart 1" in log1, logs()
    # Restart: resumed from exactly that checkpoint, ran the rest, no second signal.
    assert f"resumed after step {stop_step} from {stop_path}\n" in log2, logs()
    assert f"step {PPO_STEPS:>4}/{PPO_STEPS} " in log2 and "checkpoint after step" not in log2, logs()
    assert f"step {stop_step:>4}/{PPO_STEPS} " not in log2, logs()  # not redone
    # No step lost, none repeated.
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        steps = [json.loads(line)["step"] for line in fh if line.strip()]
    assert steps == list(range(1, PPO_STEPS + 1)), logs()
    # The checkpoint directory ends at the final step.
    ckpts = os.path.join(run_dir, "checkpoints")
    assert read_or_reason(os.path.join(ckpts, "latest")).strip() == f"step_{PPO_STEPS:08d}", sorted(os.listdir(ckpts))
    with open(os.path.join(ckpts, f"step_{PPO_STEPS:08d}", "meta.json")) as fh:
        meta = json.load(fh)
    assert (meta["step"], meta["complete"], meta["world_size"]) == (PPO_STEPS, True, 2), meta


def test_a_job_with_generator_ranks_runs_under_the_script(slurm, tmp_path):
    """rollout.ranks under sbatch + torchrun: the preflight validates the split for the job's
    world (3 ranks: 2 train, 1 generates), the ranks meet in torchrun's store, the async job ends
    COMPLETED with every step logged once."""
    overrides = [*TINY, "trainer.steps=3", "rollout.ranks=1", "trainer.mode=async", "distributed.device=cpu",
                 "distributed.backend=gloo"]
    knobs = _knobs(tmp_path, COMMAND="train", CONFIG="", NPROC_PER_NODE="3", RUN_NAME="gen",
                   OVERRIDES=" ".join(overrides))
    job = slurm.sbatch(SCRIPT, f"--output={tmp_path}/slurm-%j.out", env=knobs, cwd=REPO)
    state, code = slurm.wait(job, timeout=JOB_TIMEOUT)
    log = read_or_reason(run_log_path(os.path.join(tmp_path, "gen"), job))
    assert (state, code) == ("COMPLETED", 0), _job_output(tmp_path, job, "gen")
    assert "layout: tp=1 pp=1 cp=1 dp=2" in log and "generators: 1 rank(s)" in log, log
    with open(os.path.join(tmp_path, "gen", "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2]
