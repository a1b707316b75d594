"""The command line as users run it: real processes, real exit codes, real output."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo_cpu.yaml")


def cli(*args, env=None, timeout=300):
    """Run the CLI as a process of its own (forked, ranks too, from a server that imported torch once:
    :mod:`megatron_rl.testing.cli_runner`); return (process, seconds).  ``timeout`` is the bound on a
    hung job: generous, and far below the 600 s collective timeout that a rank left waiting would
    otherwise sit out."""
    from megatron_rl.testing.cli_runner import timed_cli

    if any(k.startswith("PYTHON") for k in env or {}):  # read at start-up: a new interpreter
        full_env = dict(os.environ, **env)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "megatron_rl.tools.cli", *args], cwd=ROOT, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        return proc, time.monotonic() - start
    return timed_cli(*args, env=env, timeout=timeout)


def fault(spec: str, nproc: int, tmp_path, *overrides: str):
    """A smoke job with one injected fault (``MEGATRON_RL_FAULT``); the time is printed, not asserted:
    a loaded 2-core machine takes minutes to start the ranks."""
    proc, seconds = cli("smoke", "--nproc", str(nproc), *overrides, f"run.dir={tmp_path}",
                        env={"MEGATRON_RL_FAULT": spec})
    print(f"{spec}: job ended in {seconds:.1f}s")
    return proc


def losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", text)]


def cli_in_process(capsys, *args) -> tuple[int, str]:
    """``megatron_rl.tools.cli.main`` in this process, for commands that stop before any rank starts;
    returns (exit code, stderr)."""
    from megatron_rl.tools.cli import main

    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def test_bad_override_exits_2_with_one_line(tmp_path, capsys):
    proc, _ = cli("smoke", "--nproc", "4", "parallel.tp=3", f"run.dir={tmp_path}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["config error: parallel.tp=3: world size 4 is not divisible by tp*pp*cp; fix: choose "
                     "tp*pp*cp that divides 4, or start a multiple of tp*pp*cp processes "
                     "[feature matrix: Parallel layouts (world size <= 8)]"]
    # The same refusal for a mistyped key, in-process (the function the CLI runs; a process start saved).
    code, err = cli_in_process(capsys, "train", "--config", DEMO, "parallel.tpp=2")
    assert code == 2
    assert err.strip() == ("config error: parallel.tpp=2: unknown key (from the command line); "
                                   "fix: did you mean parallel.tp?")
    assert not list(tmp_path.iterdir())  # nothing was started or written


def test_validate_command(tmp_path, capsys):
    proc, _ = cli("validate", "configs/demo_cpu.yaml")
    assert proc.returncode == 0 and "config OK for 4 rank(s)" in proc.stdout
    code, err = cli_in_process(capsys, "validate", DEMO, "--world-size", "6")
    assert code == 2 and "world size 6" in err


@pytest.mark.slow
def test_smoke_command_runs_on_four_processes(tmp_path):
    proc, seconds = cli("smoke", "--config", "configs/smoke_cpu.yaml", "--nproc", "4",
                        "parallel.tp=2", "parallel.pp=2", "smoke.steps=6", f"run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    found = losses(proc.stdout)
    print(f"smoke TP2xPP2 in {seconds:.1f}s: {found}")
    assert len(found) == 6 and found[-1] < found[0] - 0.1
    assert "tp=2 pp=2" in proc.stdout
    assert (tmp_path / "smoke_cpu" / "config.yaml").is_file()


@pytest.mark.slow
def test_rank_that_raises_ends_job_with_its_traceback(tmp_path):
    proc = fault("raise@rank=2:step=2", 4, tmp_path, "parallel.tp=2")
    assert proc.returncode == 1
    assert "megatron-rl: rank 2 failed (exit code 1); stopped the other 3 rank(s)" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1
    assert "injected fault on rank 2 at step 2" in proc.stderr


@pytest.mark.slow
def test_rank_that_hangs_is_stopped_by_the_timeout(tmp_path):
    proc = fault("hang@rank=1:step=2", 2, tmp_path, "distributed.timeout_s=8")
    assert proc.returncode == 1
    assert "another rank is hung or dead" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1


@pytest.mark.slow
def test_rank_killed_by_signal_ends_job(tmp_path):
    proc = fault("kill@rank=1:step=2", 2, tmp_path)
    assert proc.returncode != 0
    assert "rank 1 died (signal 9)" in proc.stderr


def test_features_command_prints_versions_and_patches():
    proc, _ = cli("features")
    assert proc.returncode == 0
    assert "megatron-core 0.19.2" in proc.stdout and "Tensor parallelism" in proc.stdout
    assert "cpu.cuda_placement_to_cpu" in proc.stdout


def param_count_body(overrides: list[str]) -> int:
    """Parameters of the actor ``overrides`` builds on one process (vocabulary unpadded)."""
    import torch

    from megatron_rl.config.loader import load_config
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.testing.layouts import use_layout

    cfg = load_config(None, overrides + ["model.make_vocab_size_divisible_by=1"])
    chunks = build_gpt_chunks(cfg.model, use_layout(), torch.device("cpu"))
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


def test_train_says_what_it_loaded_and_a_finished_rerun_exits_at_once(tmp_path):
    from megatron_rl.testing.harness import run_distributed
    from tests.support.helpers import TINY

    args = ("train", *TINY, "trainer.steps=1", f"run.dir={tmp_path}", "run.name=r")
    first, first_s = cli(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    lines = first.stdout.splitlines()
    startup = {line.split(":")[0]: line for line in lines[:8]}
    assert startup["layout"] == "layout: tp=1 pp=1 cp=1 dp=1 ep=1, world size 1, cpu"
    assert startup["tokenizer"] == "tokenizer: char (vocab 54)"
    assert startup["prompts"] == "prompts: 20 from task:add_small"
    count = run_distributed(1, param_count_body, list(TINY))[0]
    assert startup["model"] == (f"model: random init (seed 1234): {count:,} parameters (2 layers, hidden 32); "
                                "built actor, reference, critic")
    assert startup["batching"] == "batching: 2 sequence(s) per micro-batch (batch.micro_batch_size)"
    # The job waits for its last checkpoint: it says so before, and how long it took after.
    ckpt = str(tmp_path / "r" / "checkpoints")
    assert f"checkpoint: writing step 1 to {ckpt} before exiting ..." in lines
    assert any(line.startswith(f"checkpoint: step 1 saved to {ckpt}/step_00000001 in ") for line in lines)

    again, again_s = cli(*args)
    print(f"first run {first_s:.1f}s, finished re-run {again_s:.1f}s")
    assert again.returncode == 0 and again.stderr == ""  # no warnings: no model or rank was started
    assert again.stdout.splitlines() == [
        f"run finished: step 1 of trainer.steps=1 is done in {tmp_path / 'r'}; nothing to do. To train further: "
        f"trainer.steps=<more than 1>; to start fresh: run.name=<new name>, or trainer.resume=never "
        f"(moves this run's checkpoints and metrics to {tmp_path / 'r'}/replaced/)"]
    assert again_s < first_s


def test_fresh_start_in_a_used_run_directory_keeps_the_old_run_and_does_not_mix_with_it(tmp_path):
    """trainer.resume=never where an earlier run saved step 2: the fresh run's step 1 is kept (the
    old step 2 used to outrank it, and retention deleted it), the old run -- its config.yaml
    included -- is moved aside, not deleted, and can be resumed there; a later
    trainer.resume=auto continues the fresh run."""
    from megatron_rl.testing.cli_runner import timed_cli as cli  # a process each, without the import of one
    from tests.support.helpers import TINY

    common = ["train", *TINY, f"run.dir={tmp_path}", "run.name=r"]
    first, _ = cli(*common, "trainer.steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    fresh, _ = cli(*common, "trainer.steps=1", "trainer.resume=never")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    run = tmp_path / "r"
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_00000001"]
    (moved,) = os.listdir(run / "replaced")
    assert sorted(os.listdir(run / "replaced" / moved / "checkpoints")) == ["latest", "step_00000002"]
    assert len((run / "replaced" / moved / "metrics.jsonl").read_text().splitlines()) == 2
    # The old run's own config.yaml went with it (it used to be overwritten by the fresh run's) ...
    assert "steps: 2" in (run / "replaced" / moved / "config.yaml").read_text()
    assert "resume: never" in (run / "config.yaml").read_text()
    assert f"the previous run (checkpoints, metrics, config.yaml) moved to {run / 'replaced' / moved}" in fresh.stdout
    later, _ = cli(*common, "trainer.steps=2")
    assert later.returncode == 0, later.stderr[-2000:]
    assert f"resumed after step 1 from {run / 'checkpoints' / 'step_00000001'}" in later.stdout + later.stderr
    # ... so the old run can be resumed where it was moved, from its own record.
    old_run = run / "replaced" / moved
    old, _ = cli("train", "--config", str(old_run / "config.yaml"), f"run.dir={run / 'replaced'}",
                 f"run.name={moved}", "trainer.steps=3")
    assert old.returncode == 0, old.stderr[-2000:]
    assert f"resumed after step 2 from {old_run / 'checkpoints' / 'step_00000002'}" in old.stdout + old.stderr


EARLY_EXIT_REWARDS = '''
import ctypes
import os


def python_exit(prompts, responses, answers, **kwargs):
    os._exit(0)


def c_exit(prompts, responses, answers, **kwargs):
    ctypes.CDLL(None).exit(0)  # a C library ending the process: no Python frame to report
'''
SHORT_JOB = ["--config", "configs/demo_cpu.yaml", "parallel.tp=1", "parallel.pp=1", "trainer.steps=2",
             "trainer.sft_warmup_steps=0", "trainer.prompts_per_step=2", "rollout.n=2",
             "rollout.max_new_tokens=2", "trainer.plot=false",
             "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64"]  # no bigger model needed


@pytest.mark.slow
@pytest.mark.parametrize("nproc, reward", [(1, "python_exit"), (2, "python_exit"), (2, "c_exit")])
def test_a_reward_that_ends_the_process_with_code_0_fails_the_job_naming_the_rank_and_phase(tmp_path, nproc, reward):
    """Any library a reward imports can call exit(0): the job must not end 0 having trained nothing."""
    (tmp_path / "early_exit_rewards.py").write_text(EARLY_EXIT_REWARDS)
    proc, seconds = cli("train", "--nproc", str(nproc), *SHORT_JOB, f"reward.fn=early_exit_rewards:{reward}",
                        f"run.dir={tmp_path}/runs", env={"PYTHONPATH": f"{tmp_path}:{ROOT}"})
    print(f"nproc {nproc}, {reward}: exit {proc.returncode} in {seconds:.1f}s\n{proc.stderr[-600:]}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()
    if reward == "python_exit":
        line = next(x for x in last if "ended early" in x)
        assert re.search(r"rank [01] ended early: os\._exit\(0\) was called at ", line), line
        assert "early_exit_rewards.py:7 in python_exit() while in step 1, reward" in line, line
    else:
        assert any(re.search(r"rank [01] exited with code 0 before its work was done \(in step 1, reward\)", x)
                   for x in last), last
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "runs").glob("*/checkpoints/step_*"))


def _launched_ranks(launcher_pid: int) -> list[int]:
    ranks = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher_pid:
            ranks.append(int(entry))
    return ranks


def _take_the_rendezvous_port(launcher: subprocess.Popen, held: list) -> None:
    """Bind the port the launcher told its ranks (``MASTER_PORT``) before rank 0 can, as another job or
    any process binding port 0 may in the seconds rank 0 spends importing torch."""
    while launcher.poll() is None and not held:
        for pid in _launched_ranks(launcher.pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
            except OSError:
                continue
            port = int(env.get(b"MASTER_PORT", b"0"))
            held.append(port)
            if port:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.bind(("127.0.0.1", port))
                    sock.listen()
                    held.append(sock)
                except OSError:  # rank 0 was first
                    sock.close()
            return
        time.sleep(0.005)


@pytest.fixture(scope="module")
def four_jobs_at_once(tmp_path_factory):
    """Four 2-rank jobs started at the same moment, while another process binds the port the first
    job's launcher told its ranks (``MASTER_PORT``) as soon as it can read it: one run shared by the
    two port tests.  Returns ([(returncode, stderr)] per job, held)."""
    import threading

    tmp_path = tmp_path_factory.mktemp("four_jobs")
    cmd = [sys.executable, "-m", "megatron_rl.tools.cli", "train", "--nproc", "2", *SHORT_JOB, "trainer.steps=1"]
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT"}
    jobs = [subprocess.Popen([*cmd, f"run.dir={tmp_path}/{i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(4)]
    held: list = []
    thief = threading.Thread(target=_take_the_rendezvous_port, args=(jobs[0], held))
    thief.start()
    results = [job.communicate(timeout=600) for job in jobs]
    thief.join()
    for item in held[1:]:
        item.close()
    print(f"job 0's ranks were told MASTER_PORT={held[:1]}; taken by another process: {len(held) > 1}")
    return [(job.returncode, err) for job, (_, err) in zip(jobs, results)], held


@pytest.mark.slow
def test_a_job_starts_even_when_another_process_binds_the_port_its_ranks_were_told(four_jobs_at_once):
    """A launcher that picks a free port and lets rank 0 bind it seconds later loses it to whoever binds
    first (EADDRINUSE, the job dies).  The ranks now rendezvous on a port rank 0 itself got from the
    kernel, so there is no told-but-unbound port to take."""
    results, held = four_jobs_at_once
    code, err = results[0]  # the job whose told port was taken
    assert code == 0, err[-2000:]
    assert held, "the test never saw the launched ranks"


@pytest.mark.slow
def test_four_jobs_started_at_once_all_start(four_jobs_at_once):
    """N jobs on one machine at the same moment must not pick the same rendezvous port."""
    results, _ = four_jobs_at_once
    for code, err in results:
        assert code == 0, err[-2000:]
