"""scripts/slurm/ppo.sbatch with NODES=2 on one CPU machine: two network namespaces as two nodes.

    pytest -m slow tests/test_multinode.py

:class:`tests.support.netns.NodePair` makes the nodes: a veth pair between two namespaces, each
node with its own address, hostname and hosts file, so torchrun and gloo see what they see on a
cluster node (the first node's name is the rendezvous host; gloo listens on the address the
node's name resolves to, the veth's).  Without root or iproute2 the tests skip with the reason.

No Slurm runs here (the local test cluster of tests/support/local_slurm.py has one node); the
test plays Slurm's part and nothing else.  On a cluster the batch script
runs on the first node and srun starts its task (torchrun) on every node; here the script runs on
each node (the config check only on the first, as there), with two stand-ins on PATH: ``srun``
drops its own options and runs this node's task, the torchrun line exactly as the script builds
it; ``scontrol show hostnames`` lists the nodes.  What Slurm itself adds when a task fails
(``srun --kill-on-bad-exit`` ending the other nodes' tasks) is not exercised: the surviving node
must end by itself, and does.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import time

import pytest

from tests.support.helpers import TINY, read_or_reason, started_or_skipped, venv_dir
from tests.support.local_slurm import _INHERITED_BLOCKLIST
from tests.support.netns import NetnsUnavailable, NodePair

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "slurm", "ppo.sbatch")
# Only a hang waits this long: a start-up of torch + megatron takes ~15 s on an idle 2-core
# machine, and minutes when other jobs load it.
JOB_TIMEOUT = 300
# A lost node must end the job far sooner than any timeout involved: distributed.timeout_s
# (600 s by default, left so here), torchrun's 60 s store connection and rendezvous timeouts.
PROMPT_S = 30
# TP across the nodes: every layer's forward and backward talks over the veth.
OVERRIDES = [*TINY, "parallel.tp=2", "distributed.device=cpu", "distributed.backend=gloo"]

SRUN = """#!/bin/bash
# srun stand-in: run this node's task of the step (the test starts one per node): drop srun's options.
printf '%q ' "$@" >> "$MRL_SRUN_LOG.$(hostname)"
while [ $# -gt 0 ] && [[ $1 == -* ]]; do shift; done
exec "$@"
"""
SCONTROL = """#!/bin/bash
# scontrol stand-in: `show hostnames a,b` lists the nodes one a line.
[ "$1 $2" = "show hostnames" ] || { echo "scontrol stand-in: only 'show hostnames'" >&2; exit 1; }
tr , '\\n' <<< "$3"
"""


@pytest.fixture(scope="module")
def nodes():
    pair = NodePair()
    yield from started_or_skipped(pair, pair.start, pair.close, NetnsUnavailable, "no network namespaces")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    path = tmp_path_factory.mktemp("multinode")
    (path / "bin").mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (path / "bin" / name).write_text(text)
        (path / "bin" / name).chmod(0o755)
    return path




class Job:
    """One submission: the script started on both nodes with the same knobs (as srun would)."""

    def __init__(self, nodes: NodePair, work, job_id: int, overrides: list[str], preflight: bool = True):
        self.work, self.job_id = work, job_id
        self.run_dir = os.path.join(work, "ppo")
        self.log = os.path.join(self.run_dir, "logs", f"slurm-{job_id}.log")
        self.procs = []
        for node in range(2):
            env = {k: v for k, v in os.environ.items()
                   if not _INHERITED_BLOCKLIST.search(k) and k != "GLOO_SOCKET_IFNAME"}
            env.update(COMMAND="train", NODES="2", NPROC_PER_NODE="1", RUN_DIR=str(work), RUN_NAME="ppo",
                       VENV=venv_dir(), OVERRIDES=" ".join(overrides),
                       SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST=",".join(nodes.hostnames),
                       SLURM_SUBMIT_DIR=REPO, PATH=f"{work}/bin{os.pathsep}{env.get('PATH', '')}",
                       MRL_SRUN_LOG=os.path.join(work, f"srun-{job_id}"),
                       # The config check runs once per job, in the batch shell on the first node.
                       PREFLIGHT="1" if node == 0 and preflight else "0")
            with open(os.path.join(work, f"job{job_id}-node{node}.out"), "wb") as out:
                self.procs.append(nodes.popen(node, ["bash", SCRIPT], env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                                              stdout=out, stderr=subprocess.STDOUT))
        self.deadline = time.monotonic() + JOB_TIMEOUT

    def wait(self) -> list[int]:
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(1.0, self.deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"job {self.job_id} still running after {JOB_TIMEOUT}s\n{self.output()}")
        return codes

    def wait_for_log(self, pattern: str) -> None:
        while not re.search(pattern, read_or_reason(self.log), re.M):
            if time.monotonic() > self.deadline or any(p.poll() is not None for p in self.procs):
                pytest.fail(f"job {self.job_id}: no {pattern!r} in its log\n{self.output()}")
            time.sleep(0.2)

    def srun_argv(self, node: int, nodes: NodePair) -> list[str]:
        return shlex.split(read_or_reason(os.path.join(self.work, f"srun-{self.job_id}.{nodes.hostnames[node]}")))

    def output(self) -> str:
        outs = [f"--- node {n} ---\n" + read_or_reason(os.path.join(self.work, f"job{self.job_id}-node{n}.out"))
                for n in range(2)]
        return "\n".join([f"--- {self.log} ---", read_or_reason(self.log)[-12000:], *outs])


def _metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="module")
def first_job(nodes, work):
    """Two PPO steps, TP=2 across the nodes: the job the other tests build on."""
    sent = [nodes.sent_bytes(n) for n in range(2)]
    job = Job(nodes, work, 101, [*OVERRIDES, "trainer.steps=2"])
    job.codes = job.wait()
    job.sent = [nodes.sent_bytes(n) - sent[n] for n in range(2)]
    print(f"bytes sent over the veth by node 0, node 1: {job.sent}")
    return job


def test_ppo_job_spans_two_nodes(nodes, first_job):
    """Both nodes run the script's torchrun line, rendezvous on the first node and train one model
    split over them (TP=2: the ranks talk over the veth, nothing else joins the namespaces)."""
    job = first_job
    assert job.codes == [0, 0], job.output()
    head = nodes.hostnames[0]
    for node in range(2):
        argv = job.srun_argv(node, nodes)
        assert {"--kill-on-bad-exit=1", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"} <= set(argv), argv
        torchrun = argv[argv.index("torchrun"):]
        assert {"--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={head}:20101",
                "--rdzv-id=megatron-rl-101", "trainer.resume=auto"} <= set(torchrun), torchrun
    log = read_or_reason(job.log)
    assert "layout: tp=2 pp=1 cp=1 dp=1 ep=1, world size 2, cpu" in log, job.output()
    assert log.count("training command exited with 0") == 2, job.output()
    rows = _metrics(job.run_dir)
    assert [r["step"] for r in rows] == [1, 2], rows
    for row in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "reward/mean"):
            assert math.isfinite(row[key]), (key, row)
    # TP's activations and gradients went over the veth, both ways.
    assert min(job.sent) > 100_000, job.sent
    ckpts = os.path.join(job.run_dir, "checkpoints")
    assert read_or_reason(os.path.join(ckpts, "latest")).strip() == "step_00000002"


def test_a_lost_node_ends_the_job_promptly_and_a_new_job_resumes(nodes, work, first_job):
    """SIGKILL of every process on the first node (batch shell, torchrun with the rendezvous
    store, the worker), as a node lost mid-step would: the second node's job must end non-zero
    within seconds, not sit in a collective until distributed.timeout_s.  Then the same job
    started again on both nodes resumes (trainer.resume=auto) from the first job's checkpoint."""
    assert first_job.codes == [0, 0], first_job.output()
    # Resumes from step 2 and runs on: 1000 steps leave no chance to finish before the kill.
    # (The first job checked this config already: no preflight from here on, to save time.)
    doomed = Job(nodes, work, 102, [*OVERRIDES, "trainer.steps=1000"], preflight=False)
    doomed.wait_for_log(r"^step\s+4/1000 ")
    killed = nodes.kill_all(0)
    t_kill = time.monotonic()
    try:
        code = doomed.procs[1].wait(JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the second node still runs {JOB_TIMEOUT}s after the first was killed\n{doomed.output()}")
    elapsed = time.monotonic() - t_kill
    print(f"node 0 killed ({len(killed)} processes): node 1's job exited {code} after {elapsed:.1f} s")
    assert doomed.procs[0].wait(10) == -9, doomed.output()
    assert code != 0, doomed.output()
    assert elapsed < PROMPT_S, f"{elapsed:.1f} s\n{doomed.output()}"
    log = read_or_reason(doomed.log)
    assert "resumed after step 2 from " in log, doomed.output()
    assert "training command exited with 1" in log, doomed.output()
    lost = {r["step"]: r for r in _metrics(first_job.run_dir)}

    final = Job(nodes, work, 103, [*OVERRIDES, "trainer.steps=4"], preflight=False)
    assert final.wait() == [0, 0], final.output()
    log = read_or_reason(final.log)
    ckpts = os.path.join(final.run_dir, "checkpoints")
    assert f"resumed after step 2 from {os.path.join(ckpts, 'step_00000002')}\n" in log, final.output()
    assert re.search(r"^step\s+4/4 ", log, re.M) and not re.search(r"^step\s+[12]/4 ", log, re.M), final.output()
    rows = _metrics(final.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
    # Step 3 starts from the same checkpoint as the killed job's step 3: the same numbers.
    for key in ("reward/mean", "actor/pg_loss", "critic/vf_loss"):
        assert rows[2][key] == pytest.approx(lost[3][key], rel=1e-5), (key, rows[2], lost[3])
    assert read_or_reason(os.path.join(ckpts, "latest")).strip() == "step_00000004"
    with open(os.path.join(ckpts, "step_00000004", "meta.json")) as fh:
        meta = json.load(fh)
    assert (meta["step"], meta["complete"], meta["world_size"]) == (4, True, 2), meta
