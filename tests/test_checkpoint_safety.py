"""A checkpoint from elsewhere cannot run code: every file kind a checkpoint holds, crafted the way
its author would (a pickle whose ``__reduce__`` runs a command, sizes and checksums in ``meta.json``
rewritten), is refused with one ``CheckpointError`` line and exit code 2 by every command that loads
checkpoints, and the command never runs.  Nothing but the files ``meta.json`` lists is read: a file
it does not list, a link, a manifest of another shape or a directory it names never reaches a
loader, and ``trainer.resume=auto`` passes such a step over for the previous one."""

from __future__ import annotations

import hashlib
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


def cli(*args, timeout=300, env_extra=None):
    """``python -m megatron_rl.tools.cli ARGS`` as its own process, forked from one that has torch and
    megatron imported (:func:`megatron_rl.testing.cli_runner.run_cli`): ~40 commands, one import."""
    from megatron_rl.testing.cli_runner import run_cli

    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT"}
    env.update(env_extra or {})
    return run_cli(*args, env=env, cwd=ROOT, timeout=timeout)


def update_sizes(step_dir: str, *added: str) -> None:
    """Rewrite ``meta.json``'s file sizes and checksums for the crafted files (and list ``added``
    ones), as the checkpoint's author would."""
    path = os.path.join(step_dir, "meta.json")
    with open(path) as fh:
        meta = json.load(fh)
    names = [*meta["files"], *added]
    meta["files"] = {rel: os.path.getsize(os.path.join(step_dir, rel)) for rel in names}
    meta["checksums"] = {rel: hashlib.sha256(open(os.path.join(step_dir, rel), "rb").read()).hexdigest()
                         for rel in names}
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


# ----------------------------------------------------------------------------- only what meta.json lists

# Some clusters' images set this; it turns every torch.load that does not pass weights_only into a
# plain unpickle.
UNSAFE_ENV = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


def copy_of(two_checkpoints, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(two_checkpoints, run, symlinks=True)
    return run, run / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000001"


def resume_explicitly(tmp_path, step, env_extra=None):
    return cli("train", "--nproc", "1", *TINY, "trainer.steps=3", f"run.dir={tmp_path}", "run.name=r",
               f"trainer.resume={step}", env_extra=env_extra)


def resume_auto(tmp_path, env_extra=None):
    return cli("train", "--nproc", "1", *TINY, "trainer.steps=2", f"run.dir={tmp_path}", "run.name=r",
               env_extra=env_extra)


def refused_in_one_line(proc, prefix: str) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(prefix), last


def fell_back_with_one_line(proc, skipped, previous, reason: str) -> None:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = (proc.stdout + proc.stderr).splitlines()
    warnings = [line for line in said if "skipping" in line]
    assert len(warnings) == 1 and f"checkpoint: skipping {skipped}: {reason}" in warnings[0], warnings
    assert f"resumed after step 1 from {previous}" in proc.stdout, proc.stdout[-2000:]


def test_a_file_meta_json_does_not_list_is_refused_unread(two_checkpoints, tmp_path):
    """A pickle dropped in as a part's ``common.pt`` (which megatron-core would open) has no entry
    and no checksum to forge: the step is refused before any loader runs, even where the
    environment turns off torch's weights-only default."""
    run, newest, previous = copy_of(two_checkpoints, tmp_path)
    marker = tmp_path / "code_ran"
    torch.save(RunsACommand(str(marker)), newest / "actor" / "common.pt")
    explicit = resume_explicitly(tmp_path, newest, UNSAFE_ENV)
    assert not marker.exists(), "the unlisted common.pt was unpickled"
    refused_in_one_line(explicit, f"checkpoint error: checkpoint={newest}: file actor/common.pt is not listed in "
                                  "meta.json")
    auto = resume_auto(tmp_path, UNSAFE_ENV)
    assert not marker.exists(), "the unlisted common.pt was unpickled"
    fell_back_with_one_line(auto, newest, previous, "file actor/common.pt is not listed in meta.json")


def test_a_listed_common_pt_is_read_weights_only_whatever_the_environment_says(two_checkpoints, tmp_path):
    run, newest, _ = copy_of(two_checkpoints, tmp_path)
    marker = tmp_path / "code_ran"
    torch.save(RunsACommand(str(marker)), newest / "actor" / "common.pt")
    update_sizes(str(newest), "actor/common.pt")  # listed, with its checksum, by the checkpoint's author
    proc = resume_explicitly(tmp_path, newest, UNSAFE_ENV)
    assert not marker.exists(), "common.pt was unpickled"
    refused_in_one_line(proc, f"checkpoint error: checkpoint={newest}: part 'actor' was refused: common.pt is not "
                              "plain data")


@pytest.mark.parametrize("name", ["trainer_state.pt", "actor"])
def test_links_in_a_step_directory_are_refused_not_followed(two_checkpoints, tmp_path, name):
    """The link's target holds exactly what was there (sizes and checksums match): it is the link
    itself that is refused, since it could as well point at any file of the machine."""
    run, newest, _ = copy_of(two_checkpoints, tmp_path)
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    shutil.move(newest / name, outside)
    os.symlink(outside, newest / name)
    proc = resume_explicitly(tmp_path, newest)
    refused_in_one_line(proc, f"checkpoint error: checkpoint={newest}: {name} is a symbolic link (to {outside})")


def _edit_meta(change):
    def edit(text: str) -> str:
        meta = json.loads(text)
        change(meta)
        return json.dumps(meta)
    return edit


MANIFESTS = {
    "nested_200k_deep": lambda text: "[" * 200_000,
    "empty_array": lambda text: "[]",
    "files_a_list": _edit_meta(lambda m: m.update(files=[1])),
    "parts_a_number": _edit_meta(lambda m: m.update(parts=5)),
    "step_a_word": _edit_meta(lambda m: m.update(step="two")),
    "model_setting_a_word": _edit_meta(lambda m: m["models"]["actor"].update(num_layers="two")),
}


@pytest.mark.parametrize("kind", list(MANIFESTS))
def test_a_manifest_of_another_shape_marks_the_step_corrupt(two_checkpoints, tmp_path, kind):
    run, newest, previous = copy_of(two_checkpoints, tmp_path)
    meta = newest / "meta.json"
    meta.write_text(MANIFESTS[kind](meta.read_text()))
    explicit = resume_explicitly(tmp_path, newest)
    refused_in_one_line(explicit, f"checkpoint error: checkpoint={newest}: meta.json is corrupt")
    auto = resume_auto(tmp_path)
    fell_back_with_one_line(auto, newest, previous, "meta.json is corrupt")


def test_exports_and_generation_never_open_the_directories_meta_json_names(tmp_path):
    """``meta.json`` records where the model and tokenizer came from; a crafted one could name any
    directory.  The checkpoint carries its own copies of the tokenizer files and generation
    config, and convert and generate read those; the named directory here holds files that would
    fail both commands, and leak into the export, if they were read."""
    from tests.support.helpers import make_hf_model

    model_dir = tmp_path / "model"
    make_hf_model("llama", str(model_dir))
    assert cli("convert", "--hf-model", str(model_dir), "--out", str(tmp_path / "ckpt")).returncode == 0
    step = tmp_path / "ckpt" / "step_00000000"
    assert (step / "tokenizer" / "generation_config.json").is_file()
    named = tmp_path / "private"
    named.mkdir()
    for name in ("tokenizer_config.json", "tokenizer.json", "generation_config.json"):
        (named / name).write_text("PRIVATE {")
    meta = json.loads((step / "meta.json").read_text())
    meta.update(source=str(named), tokenizer=str(named))
    (step / "meta.json").write_text(json.dumps(meta))

    out = tmp_path / "hf"
    export = cli("convert", "--checkpoint", str(step), "--hf-out", str(out))
    assert export.returncode == 0, export.stderr[-3000:]
    assert not [f.name for f in out.iterdir() if b"PRIVATE" in f.read_bytes()]
    assert (out / "generation_config.json").read_text() == (model_dir / "generation_config.json").read_text()
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    gen = cli("generate", "--checkpoint", str(step), "--input", str(rows), "--output", str(tmp_path / "out.jsonl"),
              "rollout.n=1", "rollout.max_new_tokens=2")
    assert gen.returncode == 0, gen.stderr[-3000:]


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_a_safetensors_index_naming_a_file_outside_the_model_directory_is_refused(tmp_path, where):
    from tests.support.helpers import make_hf_model

    model_dir = tmp_path / "model"
    make_hf_model("llama", str(model_dir))
    outside = tmp_path / "elsewhere" / "model-00001-of-00001.safetensors"
    outside.parent.mkdir()
    shutil.move(model_dir / "model.safetensors", outside)
    from safetensors import safe_open

    with safe_open(str(outside), "pt") as f:
        names = list(f.keys())
    shard = "../elsewhere/model-00001-of-00001.safetensors" if where == "parent" else str(outside)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, shard)}))
    proc = cli("convert", "--hf-model", str(model_dir), "--out", str(tmp_path / "ckpt"))
    refused_in_one_line(proc, f"checkpoint error: model.hf_path={model_dir}: model.safetensors.index.json maps ")
    assert f"to {shard!r}, not a .safetensors file in this directory" in proc.stderr
