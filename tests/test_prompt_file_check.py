"""A prompt file that training cannot read stops ``validate`` and ``train`` before any rank starts,
wherever the bad line is: the check before launch parses every record the way the loader does (files
up to ``FULL_CHECK_BYTES``, the first that many bytes of larger ones, saying so)."""

from __future__ import annotations

import json

import pytest

from megatron_rl.data import prompts
from megatron_rl.data.prompts import check_prompt_file, load_prompts
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.errors import DataError
from tests.test_cli import cli

BAD_LINES = {
    "json": b'{"prompt": "1+1=", "answer": "2"',
    "utf8": b'{"prompt": "caf\xe9 1+1=", "answer": "2"}',
    "list": b'["1+1=", "2"]',
    "prompt-number": b'{"prompt": 5, "answer": "2"}',
    "answer-object": b'{"prompt": "1+1=", "answer": {"value": 2}}',
    "empty-messages": b'{"messages": [], "answer": "2"}',
}


def prompt_file(tmp_path, bad: bytes | None, line: int = 500, lines: int = 1000, name: str = "prompts.jsonl"):
    """``lines`` good records, line ``line`` replaced by ``bad``."""
    rows = [json.dumps({"prompt": f"{i % 9}+1=", "answer": str(i % 9 + 1)}).encode() for i in range(lines)]
    if bad is not None:
        rows[line - 1] = bad
    path = tmp_path / name
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("kind,key", [("json", "data.train_path"), ("utf8", "data.train_path"),
                                      ("json", "data.val_path")])
def test_validate_names_a_bad_line_500(tmp_path, kind, key):
    path = prompt_file(tmp_path, BAD_LINES[kind])
    proc, _ = cli("validate", "configs/demo_cpu.yaml", f"{key}={path}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line(proc)
    assert line.startswith(f"data error: {path}:500: line 500 is not "), line
    assert "fix: " in line and ("line 500 of" in line or "as UTF-8" in line), line


@pytest.mark.parametrize("kind", ["json", "utf8"])
def test_train_stops_on_line_500_before_any_rank_starts(tmp_path, kind):
    path = prompt_file(tmp_path, BAD_LINES[kind])
    run_dir = tmp_path / "runs"
    proc, seconds = cli("train", "--config", "configs/demo_cpu.yaml", "--nproc", "2", "parallel.tp=2",
                        "parallel.pp=1", f"data.train_path={path}", f"run.dir={run_dir}")
    print(f"train refused in {seconds:.1f}s")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert one_line(proc).startswith(f"data error: {path}:500: line 500 is not "), proc.stderr
    assert "rank" not in proc.stdout + proc.stderr
    assert not run_dir.exists()  # no config.yaml, no rank logs: nothing was launched


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_the_check_and_the_loader_refuse_the_same_line_alike(tmp_path, kind):
    """One parsing path: whatever the loader refuses on line 500, the check before launch refuses with the same line."""
    path = prompt_file(tmp_path, BAD_LINES[kind])
    with pytest.raises(DataError) as loading:
        load_prompts(str(path), load_tokenizer("char"), max_prompt_tokens=64)
    with pytest.raises(DataError) as checking:
        check_prompt_file(path)
    assert str(checking.value) == str(loading.value)
    assert str(checking.value).startswith(f"data error: {path}:500: "), checking.value


def test_files_over_the_bound_are_checked_up_to_it_and_the_note_says_so(tmp_path):
    assert prompts.FULL_CHECK_BYTES == 1 << 30  # the bound the docs state (1 GiB)
    path = prompt_file(tmp_path, BAD_LINES["json"], line=900)
    size = path.stat().st_size
    notes: list[str] = []
    assert check_prompt_file(path, max_bytes=size // 2, note=notes.append) == "answer"  # line 900 is past it
    assert len(notes) == 1 and notes[0].startswith("data.train_path: checked the first "), notes
    assert f"(500 records) of {path} ({size} bytes in all; files up to {size // 2} bytes are checked whole)" in notes[0]
    with pytest.raises(DataError, match=f"{path}:900: line 900 is not valid JSON"):
        check_prompt_file(path, max_bytes=size, note=notes.append)  # within the bound: read whole
    good = prompt_file(tmp_path, None, name="good.jsonl")
    check_prompt_file(good, max_bytes=good.stat().st_size, note=notes.append)
    assert len(notes) == 1  # a file read whole needs no note
