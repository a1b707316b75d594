"""A real, private single-node Slurm cluster on localhost, for end-to-end tests of the sbatch scripts.

Mocking ``sbatch``/``srun`` would not test what breaks in practice (signal delivery, requeue,
exit-code propagation, environment export), so the tests run the real daemons:

    with LocalSlurm() as slurm:
        job = slurm.sbatch("scripts/slurm/ppo.sbatch", "--output=/tmp/x-%j.out", env={"COMMAND": "smoke"})
        state, code = slurm.wait(job, timeout=300)

Debian's ``slurm-wlm`` and ``munge`` are installed with apt-get when ``slurmctld`` is missing;
when that is impossible (not root, no apt-get, registry unreachable) :class:`SlurmUnavailable`
says why, so a test can skip with that reason.  Everything the cluster writes (munge key and
socket, ``slurm.conf``, state, spool, daemon logs) lives in one temporary directory, and the
daemons listen on free ports, so a second cluster in the same session (or a system Slurm)
does not collide with this one.

It lives under ``tests/`` because it runs apt-get as root and writes ``/usr/sbin/policy-rc.d``:
nothing a user who installs the trainer should get.

No process outlives the context: daemons and every job process carry a marker variable naming
the temporary directory, and :meth:`LocalSlurm.stop` cancels the jobs, stops the daemons it
started, then kills whatever still carries the marker (slurmstepd and job processes are not
children of ours once slurmd is gone).
"""

from __future__ import annotations

import atexit
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Callable, Iterable

from megatron_rl.distributed.env import free_port

MARKER_ENV = "MEGATRON_RL_LOCAL_SLURM"
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
})
APT_PACKAGES = ("slurm-wlm", "munge")
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
# Variables that would make the job (or the CLI inside it) think it already runs in another job.
_INHERITED_BLOCKLIST = re.compile(r"^(SLURM_|SBATCH_|SRUN_|SALLOC_|TORCHELASTIC_|PET_)|"
                                  r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|"
                                  r"MASTER_ADDR|MASTER_PORT|MEGATRON_RL_LAUNCHER|MEGATRON_RL_ERROR_FILE|MEGATRON_RL_PORT_FILE)$")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or run here; the message says why (a reason to skip)."""


class SlurmStartError(RuntimeError):
    """The daemons were installed but did not come up; the message carries their logs."""


def _which(name: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(_SBIN_DIRS)
    return shutil.which(name, path=path)


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError as err:
        return f"<{err}>"


def ensure_installed(timeout: float = 600) -> float:
    """Install slurm-wlm and munge with apt-get unless present; return the seconds spent.

    Raises :class:`SlurmUnavailable` with the reason when they are missing and cannot be installed.
    """
    if _which("slurmctld") and _which("slurmd") and _which("munged") and _which("sbatch"):
        return 0.0
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"slurmctld is not installed and installing it needs root (uid {os.geteuid()})")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("slurmctld is not installed and there is no apt-get to install slurm-wlm")
    start = time.monotonic()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # The packages' maintainer scripts would start system-wide daemons; ours run privately.
    policy = "/usr/sbin/policy-rc.d"
    made_policy = not os.path.exists(policy)
    if made_policy:
        with open(policy, "w") as fh:
            fh.write("#!/bin/sh\nexit 101\n")
        os.chmod(policy, 0o755)
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends",
               "-o", "DPkg::Lock::Timeout=120", *APT_PACKAGES]
    try:
        # Try without `apt-get update` first: on a machine with fresh lists it saves the round trip.
        result = _run_quiet(install, env, timeout)
        if result.returncode != 0:
            update = _run_quiet(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=120"], env, timeout)
            if update.returncode != 0:
                raise SlurmUnavailable(f"apt-get update failed (no network to the package registry?): "
                                       f"{_last_lines(update.stdout)}")
            result = _run_quiet(install, env, timeout)
            if result.returncode != 0:
                raise SlurmUnavailable(f"apt-get install {' '.join(APT_PACKAGES)} failed: {_last_lines(result.stdout)}")
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"apt-get did not finish within {timeout:.0f}s") from None
    finally:
        if made_policy:
            os.unlink(policy)
    if not _which("slurmctld"):
        raise SlurmUnavailable("apt-get install succeeded but slurmctld is still not on PATH")
    return time.monotonic() - start


def _run_quiet(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def _last_lines(text: str, n: int = 3) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-n:])


def parse_kv(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of one-line ``scontrol show -o`` output (values without spaces)."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z][\w:/]*)=(\S*)", text))


class LocalSlurm:
    """Context manager: a single-node Slurm (munged, slurmctld, slurmd) private to this process.

    ``cpus`` is what the node advertises; it is deliberately more than the real cores
    (``SlurmdParameters=config_overrides``) so several tasks and jobs fit on a small CI machine.
    """

    def __init__(self, cpus: int | None = None, startup_timeout: float = 60.0, install: bool = True):
        self.cpus = cpus or max(16, 4 * (os.cpu_count() or 1))
        self.startup_timeout = startup_timeout
        self.install = install
        self.dir: str | None = None
        self.conf: str | None = None
        self.timings: dict[str, float] = {}
        self._daemons: dict[str, subprocess.Popen] = {}
        self._atexit_registered = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "LocalSlurm":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "LocalSlurm":
        if self.dir is not None:
            return self  # already running
        if self.install:
            self.timings["install_s"] = ensure_installed()
        elif not _which("slurmctld"):
            raise SlurmUnavailable("slurmctld is not installed (install=False)")
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local cluster runs slurmd as root (SlurmUser=root); not root here")
        t0 = time.monotonic()
        try:
            self._prepare()
            self._start_munge()
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", self.conf])
            self._spawn("slurmd", [_which("slurmd"), "-D", "-N", "localhost", "-f", self.conf])
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        self.timings["startup_s"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Cancel jobs, stop our daemons, kill anything still carrying our marker, remove the dir."""
        if self.dir is None:
            return
        if "slurmctld" in self._daemons and self._alive("slurmctld"):
            try:
                self._cmd(["scancel", "--user", _user(), "--full"], check=False, timeout=10)
                self.wait_until(lambda: not self._cmd(["squeue", "-h", "-o", "%A"], check=False,
                                                      timeout=10).stdout.strip(), timeout=15)
            except (TimeoutError, subprocess.TimeoutExpired, OSError):
                pass  # the sweep below still ends every job process
        for name in ("slurmd", "slurmctld"):
            self._terminate(name)
        self._sweep_marked()
        self._terminate("munged")
        self._sweep_marked()
        self._daemons.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    # ------------------------------------------------------------------ setup
    def _prepare(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="local_slurm_")
        # munged wants every directory above its socket to be searchable by all.
        os.chmod(self.dir, 0o755)
        if not self._atexit_registered:
            # Safety net for a fixture whose teardown never ran; stop() is idempotent.
            atexit.register(self.stop)
            self._atexit_registered = True
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.dir, sub), mode=0o755, exist_ok=True)
        os.chmod(os.path.join(self.dir, "munge"), 0o700)
        key = os.path.join(self.dir, "munge", "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))
        self.munge_socket = os.path.join(self.dir, "munge.socket")
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        self.conf = os.path.join(self.dir, "slurm.conf")
        with open(self.conf, "w") as fh:
            fh.write(self.render_conf())

    def render_conf(self) -> str:
        d = self.dir
        return f"""\
# Generated by tests/support/local_slurm.py: a private single-node cluster for tests.
ClusterName=mrltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: the test machine may be a container without a writable cgroup tree.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# Trust the node line below over the real hardware (more CPUs than cores).
SlurmdParameters=config_overrides
# No slurmdbd: finished jobs are read with scontrol while slurmctld keeps them (MinJobAge),
# and from the job-completion file after that.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d}/log/jobcomp.txt
MinJobAge=3600
ReturnToService=2
JobRequeue=1
PropagateResourceLimits=NONE
MailProg=/bin/true
MessageTimeout=10
KillWait=5
InactiveLimit=0
SlurmdTimeout=60
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""

    def env(self, extra: dict | None = None) -> dict[str, str]:
        """Environment for Slurm clients and submitted jobs: ours, not the caller's cluster's."""
        env = {k: v for k, v in os.environ.items() if not _INHERITED_BLOCKLIST.search(k)}
        env["SLURM_CONF"] = self.conf
        env[MARKER_ENV] = self.dir
        env["PATH"] = env.get("PATH", "") + os.pathsep + os.pathsep.join(_SBIN_DIRS)
        env.update({k: str(v) for k, v in (extra or {}).items()})
        return env

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(os.path.join(self.dir, "log", f"{name}.stdout"), "ab")
        try:
            self._daemons[name] = subprocess.Popen(
                argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.dir,
            )
        finally:
            log.close()

    def _start_munge(self) -> None:
        self._spawn("munged", [
            _which("munged"), "--foreground", f"--socket={self.munge_socket}",
            f"--key-file={self.dir}/munge/munge.key", f"--pid-file={self.dir}/munge/munged.pid",
            f"--seed-file={self.dir}/munge/munged.seed", f"--log-file={self.dir}/log/munged.log",
        ])
        try:
            self.wait_until(lambda: os.path.exists(self.munge_socket) or not self._alive("munged"), 15)
        except TimeoutError:
            pass
        if not os.path.exists(self.munge_socket):
            raise SlurmStartError("munged did not create its socket\n" + self.daemon_logs())

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        state = ""
        while time.monotonic() < deadline:
            for name in ("slurmctld", "slurmd"):
                if not self._alive(name):
                    raise SlurmStartError(f"{name} exited with code {self._daemons[name].returncode}\n"
                                          + self.daemon_logs())
            res = self._cmd(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=10)
            state = res.stdout.strip()
            if res.returncode == 0 and state.rstrip("*") == "idle":
                return
            time.sleep(0.2)
        raise SlurmStartError(f"node not idle after {self.startup_timeout:.0f}s (sinfo: {state!r})\n"
                              + self.daemon_logs())

    def daemon_logs(self, lines: int = 30) -> str:
        if not self.dir:
            return ""
        parts = []
        for name in sorted(os.listdir(os.path.join(self.dir, "log"))):
            parts.append(f"--- {name} ---\n{_tail(os.path.join(self.dir, 'log', name), lines)}")
        return "\n".join(parts)

    # ------------------------------------------------------------------ process control
    def _alive(self, name: str) -> bool:
        proc = self._daemons.get(name)
        return proc is not None and proc.poll() is None

    def _terminate(self, name: str, grace: float = 10.0) -> None:
        proc = self._daemons.get(name)
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def marked_pids(self) -> list[int]:
        """Processes whose environment names this cluster: daemons, slurmstepd, job processes."""
        if not self.dir:
            return []
        needle = f"{MARKER_ENV}={self.dir}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if needle in fh.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:  # gone, or not ours to read
                continue
        return pids

    def _sweep_marked(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.marked_pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + 3
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if _exists(p)]
                time.sleep(0.05)
        for proc in self._daemons.values():  # reap our direct children
            try:
                proc.wait(1)
            except subprocess.TimeoutExpired:
                pass

    # ------------------------------------------------------------------ client side
    def _cmd(self, argv: list[str], check: bool = True, timeout: float = 30, env: dict | None = None,
             cwd: str | None = None) -> subprocess.CompletedProcess:
        res = subprocess.run(argv, env=self.env(env), stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=timeout, cwd=cwd)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def sbatch(self, script: str, *args: str, env: dict | None = None, cwd: str | None = None) -> int:
        """Submit ``script`` with sbatch ``args`` (before the script); ``env`` reaches the job."""
        res = self._cmd(["sbatch", "--parsable", *args, script], env=env, cwd=cwd)
        return int(res.stdout.strip().split(";")[0])

    def scancel(self, job_id: int, signal: str | None = None, batch: bool = False, full: bool = False) -> None:
        """Cancel, or with ``signal`` send it: to the steps (default), the batch shell only
        (``batch``, what ``--signal=B:...`` does), or both (``full``)."""
        argv = ["scancel"]
        if signal:
            argv.append(f"--signal={signal}")
        if batch:
            argv.append("--batch")
        if full:
            argv.append("--full")
        self._cmd([*argv, str(job_id)])

    def release(self, job_id: int, timeout: float = 60) -> None:
        """Make a requeued job eligible now instead of after Slurm's requeue delay.

        A requeue revokes the job's credential on its nodes, and Slurm holds the requeued job
        for ``cred_expire + 1`` s (121 s by default: ``Reason=BeginTime``) so that the revocation
        has expired before the job starts again.  A test need not sit through that, but it must
        not let the job start within the same wall-clock second as the revocation: slurmd
        compares whole seconds and refuses a credential issued at or before the revocation
        second (slurmd.log: ``Job N already killed, do not launch batch job``; slurmctld.log:
        ``Killing non-startable batch JobId=N: Job credential revoked``), and slurmctld then ends
        the restarted job ``FAILED`` with exit code 1, for good.

        So: wait until the requeue has finished (``PENDING``, no longer ``COMPLETING``; the
        revocation time, set by slurmctld when it requeued, lies at or before this moment), then
        until the next second has begun, and only then make the job eligible.  Daemons and this
        process read the same clock: the cluster is local.
        """
        self.wait_for_state(job_id, ["PENDING"], timeout)
        seen = time.time()
        time.sleep(max(0.0, math.floor(seen) + 1.05 - time.time()))
        self._cmd(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` fields; falls back to the job-completion file once purged."""
        res = self._cmd(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if res.returncode == 0 and res.stdout.strip():
            return parse_kv(res.stdout)
        comp = os.path.join(self.dir, "log", "jobcomp.txt")
        info: dict[str, str] = {}
        if os.path.exists(comp):
            with open(comp) as fh:
                for line in fh:
                    fields = parse_kv(line)
                    if fields.get("JobId") == str(job_id):
                        info = fields  # last record wins (a requeued job has several)
        return info

    def state(self, job_id: int) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait(self, job_id: int, timeout: float = 300, restarts: int = 0,
             poll: float = 0.5) -> tuple[str, int]:
        """Wait for a terminal state (after at least ``restarts`` requeues); return (state, exit code).

        The exit code is the batch script's, or 128+signal when a signal ended it.
        """
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            state = info.get("JobState", "")
            if state in TERMINAL_STATES and int(info.get("Restarts", "0") or 0) >= restarts:
                return state, _exit_code(info.get("ExitCode", "0:0"))
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} not finished after {timeout:.0f}s: {info}\n" + self.daemon_logs())

    def wait_for_state(self, job_id: int, states: Iterable[str], timeout: float = 120) -> str:
        wanted = set(states)
        found: list[str] = []

        def hit() -> bool:
            found[:] = [self.state(job_id)]
            return found[0] in wanted

        self.wait_until(hit, timeout, what=f"job {job_id} in {sorted(wanted)}")
        return found[0]

    @staticmethod
    def wait_until(predicate: Callable[[], bool], timeout: float, poll: float = 0.2, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(poll)
        raise TimeoutError(f"{what} not reached after {timeout:.0f}s")

    def wait_for_text(self, path: str, text: str, timeout: float = 300, job_id: int | None = None) -> str:
        """Wait until file ``path`` contains ``text`` (e.g. a step line in a job log); return the file.

        With ``job_id``, give up early when that job has already ended.
        """
        content = ""

        def hit() -> bool:
            nonlocal content
            try:
                with open(path, errors="replace") as fh:
                    content = fh.read()
            except OSError:
                content = ""
            if text in content:
                return True
            if job_id is not None and self.state(job_id) in TERMINAL_STATES:
                raise RuntimeError(f"job {job_id} ended before {text!r} appeared in {path}:\n{content[-3000:]}")
            return False

        self.wait_until(hit, timeout, poll=0.5, what=f"{text!r} in {path}")
        return content


def run_log_path(run_dir: str, job_id: int, restart: int = 0) -> str:
    """Where scripts/slurm/ppo.sbatch writes a job's log (one file per start of a requeued job)."""
    suffix = f"-{restart}" if restart else ""
    return os.path.join(run_dir, "logs", f"slurm-{job_id}{suffix}.log")


def _exit_code(field: str) -> int:
    code, _, sig = field.partition(":")
    code_i, sig_i = int(code or 0), int(sig or 0)
    return 128 + sig_i if sig_i and not code_i else code_i


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name
