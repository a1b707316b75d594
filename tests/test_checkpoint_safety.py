"""A checkpoint from elsewhere cannot run code: every file kind a checkpoint holds, crafted the way
its author would (a pickle whose ``__reduce__`` runs a command, sizes in ``meta.json`` updated), is
refused with one ``CheckpointError`` line and exit code 2 by every command that loads checkpoints,
and the command never runs."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from tests.support.helpers import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


class RunsACommand:
    """Unpickling this object runs ``touch <marker>``: what a crafted checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def cli(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT"}
    return subprocess.run([sys.executable, "-m", "megatron_rl.tools.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def update_sizes(step_dir: str) -> None:
    """Rewrite ``meta.json``'s file sizes for the crafted files, as the checkpoint's author would."""
    path = os.path.join(step_dir, "meta.json")
    with open(path) as fh:
        meta = json.load(fh)
    meta["files"] = {rel: os.path.getsize(os.path.join(step_dir, rel)) for rel in meta["files"]}
    meta.pop("checksums", None)
    with open(path, "w") as fh:
        json.dump(meta, fh)


def craft_trainer_state(step_dir: str, marker: str) -> None:
    torch.save(RunsACommand(marker), os.path.join(step_dir, "trainer_state.pt"))


def craft_rng(step_dir: str, marker: str) -> None:
    torch.save({"python": RunsACommand(marker)}, os.path.join(step_dir, "rng", "rank_00000.pt"))


def craft_metadata(step_dir: str, marker: str) -> None:
    with open(os.path.join(step_dir, "actor", ".metadata"), "wb") as fh:
        pickle.dump(RunsACommand(marker), fh)


def craft_extra_state(step_dir: str, marker: str) -> None:
    """Point one ``_extra_state`` byte item of the actor at a payload appended to its ``.distcp``."""
    meta_path = os.path.join(step_dir, "actor", ".metadata")
    with open(meta_path, "rb") as fh:
        metadata = pickle.load(fh)  # our own, freshly written file
    index = next(i for i in metadata.storage_data if "_extra_state" in i.fqn)
    info = metadata.storage_data[index]
    target = os.path.join(step_dir, "actor", info.relative_path)
    buffer = io.BytesIO()
    torch.save(RunsACommand(marker), buffer)
    payload = buffer.getvalue()
    offset = os.path.getsize(target)
    with open(target, "ab") as fh:
        fh.write(payload)
    info.offset, info.length = offset, len(payload)
    with open(meta_path, "wb") as fh:
        pickle.dump(metadata, fh)


CRAFTS = {"trainer_state.pt": craft_trainer_state, "rng/rank_00000.pt": craft_rng,
          "actor/.metadata": craft_metadata, "_extra_state in actor/*.distcp": craft_extra_state}


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    """A real one-step run with its final checkpoint."""
    root = tmp_path_factory.mktemp("source")
    proc = cli("train", "--nproc", "1", *TINY, "trainer.steps=1", f"run.dir={root}", "run.name=src")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "src"


def crafted_copy(source_run, tmp_path, kind: str):
    run = tmp_path / kind.replace("/", "_").replace(" ", "_").replace("*", "x")
    shutil.copytree(source_run, run / "src")
    step = run / "src" / "checkpoints" / "step_00000001"
    marker = run / "code_ran"
    CRAFTS[kind](str(step), str(marker))
    update_sizes(str(step))
    return run, step, marker


def entry_point(name: str, run, step) -> list[str]:
    if name == "trainer.resume":
        return ["train", "--nproc", "1", *TINY, "trainer.steps=2", f"run.dir={run}", "run.name=src"]
    if name == "actor.init_checkpoint":
        return ["train", "--nproc", "1", *TINY, "trainer.steps=1", f"run.dir={run}", "run.name=fresh",
                f"actor.init_checkpoint={step}", "trainer.resume=never"]
    if name == "convert --checkpoint":
        return ["convert", "--checkpoint", str(step), "--hf-out", str(run / "hf"), *TINY[:7]]
    if name == "generate --checkpoint":
        rows = run / "in.jsonl"
        rows.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
        return ["generate", "--checkpoint", str(step), "--input", str(rows), "--output", str(run / "out.jsonl"),
                *TINY, "rollout.n=1"]
    raise KeyError(name)


# Every file kind on the entry point that reads it (``trainer.resume`` reads all four), and the
# model files on every other entry point.
CASES = [(kind, "trainer.resume") for kind in CRAFTS] + [
    (kind, entry) for entry in ("actor.init_checkpoint", "convert --checkpoint", "generate --checkpoint")
    for kind in ("actor/.metadata", "_extra_state in actor/*.distcp")
]


def test_crafted_checkpoints_are_refused_and_run_nothing(source_run, tmp_path):
    def attempt(case):
        kind, entry = case
        run, step, marker = crafted_copy(source_run, tmp_path / entry.split()[0], kind)
        proc = cli(*entry_point(entry, run, step))
        return case, proc, marker.exists()

    # One at a time: single-process jobs pick a free rendezvous port before they bind it, so two
    # started at once can pick the same one.
    results = [attempt(case) for case in CASES]
    failures = []
    for (kind, entry), proc, code_ran in results:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        refused = proc.returncode == 2 and any(ln.startswith("checkpoint error") for ln in lines) and \
            "Traceback" not in proc.stderr
        if code_ran or not refused:
            failures.append(f"{kind} via {entry}: exit {proc.returncode}, code ran: {code_ran}, "
                            f"stderr tail: {proc.stderr[-600:]!r}")
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    proc = cli("train", "--nproc", "1", *TINY, "trainer.steps=2", "trainer.save_every=1", f"run.dir={root}",
               "run.name=r")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "r"


def corrupt_same_size(path) -> None:
    """Overwrite bytes in the middle of a file with garbage, keeping its size (size checks pass)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes((b + 1) % 256 for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("victim", ["actor/__0_0.distcp", "trainer_state.pt", "rng/rank_00000.pt",
                                    "actor/.metadata"])
def test_a_corrupted_checkpoint_is_named_and_resume_auto_falls_back(two_checkpoints, tmp_path, victim):
    run = tmp_path / "r"
    shutil.copytree(two_checkpoints, run)
    newest = run / "checkpoints" / "step_00000002"
    corrupt_same_size(newest / victim)
    explicit = cli("train", "--nproc", "1", *TINY, "trainer.steps=3", f"run.dir={tmp_path}", "run.name=r",
                   f"trainer.resume={newest}")
    assert explicit.returncode == 2 and "Traceback" not in explicit.stderr, explicit.stderr[-3000:]
    last = explicit.stderr.strip().splitlines()[-1]
    assert last.startswith(f"checkpoint error: checkpoint={newest}: file {victim} does not match its sha256"), last
    auto = cli("train", "--nproc", "1", *TINY, "trainer.steps=3", f"run.dir={tmp_path}", "run.name=r")
    assert auto.returncode == 0, auto.stderr[-3000:]
    said = auto.stdout + auto.stderr
    assert f"checkpoint: skipping {newest}: file {victim} does not match" in said
    assert f"resumed after step 1 from {run / 'checkpoints' / 'step_00000001'}" in said


def test_resuming_with_another_model_shape_names_the_setting(two_checkpoints, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(two_checkpoints, run)
    overrides = [o for o in TINY if not o.startswith("model.hidden_size=")] + ["model.hidden_size=64"]
    proc = cli("train", "--nproc", "1", *overrides, "trainer.steps=3", f"run.dir={tmp_path}", "run.name=r")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("checkpoint error: model.hidden_size=64: the checkpoint's actor was saved with "
                           "model.hidden_size=32"), last


def test_a_single_process_job_that_fails_on_its_checkpoint_tears_its_process_groups_down(two_checkpoints, tmp_path):
    """A one-process job (no launcher) that stops on bad input returns with its process groups
    destroyed: left alive, their gloo threads race the interpreter's teardown, and the process can
    abort after printing its one line (exit -6, "terminate called without an active exception")."""
    run = tmp_path / "r"
    shutil.copytree(two_checkpoints, run)
    newest = run / "checkpoints" / "step_00000002"
    corrupt_same_size(newest / "rng" / "rank_00000.pt")
    argv = ["train", *TINY, "trainer.steps=3", f"run.dir={tmp_path}", "run.name=r", f"trainer.resume={newest}"]
    script = (
        "import torch.distributed as dist\n"
        "from megatron.core import parallel_state as ps\n"
        "from megatron_rl.tools.cli import main\n"
        f"code = main({argv!r})\n"
        "print('code', code, 'initialized', dist.is_initialized(), "
        "'model_parallel', ps.model_parallel_is_initialized())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "code 2 initialized False model_parallel False" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
