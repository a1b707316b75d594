"""Prompt lengths are judged before launch on the prompts actually read.

``validate`` says what ``train`` will do with prompts longer than ``data.max_prompt_tokens`` (drop
them, or stop when none remain), decided by the loader's own rule; ``generate`` checks the model's
positions against the longest prompt of its input plus ``rollout.max_new_tokens``, with the same
line on every layout.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.data.prompts import check_prompt_file, load_prompts
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.errors import DataError
from megatron_rl.tools.cli import main
from tests.test_cli import ROOT, cli

DEMO = f"{ROOT}/configs/demo_cpu.yaml"  # char tokenizer, data.max_prompt_tokens=16
CHAR = load_tokenizer("char")


def prompt_file(path, lengths: tuple[int, ...]):
    """One record per length, its prompt that many tokens long (the BOS included)."""
    path.write_text("".join(json.dumps({"prompt": "1" * (n - 1), "answer": "1"}) + "\n" for n in lengths))
    return path


def validate(capsys, tmp_path, *overrides: str) -> tuple[int, str, str]:
    code = main(["validate", DEMO, f"run.dir={tmp_path}/runs", *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


ALL_TOO_LONG = ("data error: data.max_prompt_tokens=16: all 3 prompts in {path} are longer than 16 tokens (the "
                "longest has 31, the shortest 20); fix: raise data.max_prompt_tokens to 20 or more (31 keeps every "
                "prompt), or shorten the prompts")


@pytest.mark.parametrize("key,more", [("data.train_path", []), ("data.val_path", ["trainer.eval_every=1"])])
def test_validate_refuses_a_file_whose_every_prompt_is_too_long_with_the_loaders_line(capsys, tmp_path, key, more):
    path = prompt_file(tmp_path / "long.jsonl", (20, 31, 25))
    code, _, err = validate(capsys, tmp_path, f"{key}={path}", *more)
    assert code == 2, err
    assert err == ALL_TOO_LONG.format(path=path)
    with pytest.raises(DataError) as loading:  # what train stops on when its ranks load the file
        load_prompts(str(path), CHAR, max_prompt_tokens=16)
    assert str(loading.value) == err
    assert not (tmp_path / "runs").exists()


def test_validate_says_how_many_prompts_training_will_drop(capsys, tmp_path):
    path = prompt_file(tmp_path / "some.jsonl", (5, 20, 16, 31, 9))
    code, out, err = validate(capsys, tmp_path, f"data.train_path={path}")
    assert code == 0 and "config OK" in out, err
    assert err == (f"data.train_path: training drops 2 of 5 prompts in {path}: longer than data.max_prompt_tokens=16 "
                   "(the longest has 31 tokens)")
    code, out, err = validate(capsys, tmp_path, f"data.train_path={path}", "data.max_prompt_tokens=31")
    assert code == 0 and err == "", err  # every prompt fits: nothing to say


def test_validate_of_an_unused_evaluation_file_does_not_judge_its_lengths(capsys, tmp_path):
    path = prompt_file(tmp_path / "long.jsonl", (20, 31, 25))
    code, _, err = validate(capsys, tmp_path, f"data.val_path={path}", "trainer.eval_every=0")
    assert code == 0 and err == "", err


def test_a_built_in_task_whose_every_prompt_is_too_long_is_refused_alike(capsys, tmp_path):
    code, _, err = validate(capsys, tmp_path, "data.max_prompt_tokens=2")
    assert code == 2
    assert err.startswith("data error: data.max_prompt_tokens=2: all ") and "prompts in task:add_small are " \
        "longer than 2 tokens" in err, err


def test_the_length_check_keeps_the_bound_of_the_file_check(tmp_path):
    """Past ``max_bytes`` only the first records are read: long ones there are not all the file has,
    so the check notes what it saw instead of refusing."""
    path = prompt_file(tmp_path / "big.jsonl", (20,) * 50 + (5,) * 50)
    first_50 = sum(len(line) for line in path.read_bytes().splitlines(keepends=True)[:50])
    notes: list[str] = []
    check_prompt_file(path, max_bytes=first_50, note=notes.append, tokenizer=CHAR, max_prompt_tokens=16)
    assert len(notes) == 2 and notes[0].startswith("data.train_path: checked the first "), notes
    assert notes[1] == (f"data.train_path: training drops 50 of the first 50 prompts in {path}: longer than "
                        "data.max_prompt_tokens=16 (the longest has 20 tokens)")
    with pytest.raises(DataError, match="all 50 prompts .* are longer than 16 tokens"):
        check_prompt_file(prompt_file(tmp_path / "long.jsonl", (20,) * 50), note=notes.append, tokenizer=CHAR,
                          max_prompt_tokens=16)


def test_train_stops_before_any_rank_starts_when_no_prompt_fits(tmp_path):
    path = prompt_file(tmp_path / "long.jsonl", (20, 31, 25))
    run_dir = tmp_path / "runs"
    proc, seconds = cli("train", "--config", "configs/demo_cpu.yaml", "--nproc", "2", "parallel.tp=2",
                        "parallel.pp=1", f"data.train_path={path}", f"run.dir={run_dir}")
    print(f"train refused in {seconds:.1f}s")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ALL_TOO_LONG.format(path=path)
    assert not run_dir.exists()


# ----------------------------------------------------------------------------- generate: positions

def short_window_model(tmp_path) -> str:
    """The tiny HF llama with a 64-position window (far below data.max_prompt_tokens' default 512)."""
    from tests.support.helpers import make_hf_model

    hf_dir = tmp_path / "hf"
    make_hf_model("llama", str(hf_dir))
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=64)))
    return str(hf_dir)


LAYOUTS = {"tp2": ["--nproc", "2", "parallel.tp=2"], "tp2xcp2": ["--nproc", "4", "parallel.tp=2", "parallel.cp=2"]}
GREEDY = ["rollout.n=1", "rollout.max_new_tokens=5", "rollout.temperature=0"]


def test_generate_refuses_a_prompt_past_the_positions_with_one_line_on_every_layout(capsys, tmp_path):
    hf_dir = short_window_model(tmp_path)
    capsys.readouterr()  # the model writer's progress bar
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"prompt_ids": [3, 9, 27]}) + "\n" + json.dumps({"prompt_ids": [5] * 62}) + "\n")
    lines = {}
    for name, layout in LAYOUTS.items():
        code = main(["generate", "--hf-model", hf_dir, "--input", str(rows), "--output", str(tmp_path / "out.jsonl"),
                     *layout, *GREEDY])
        lines[name] = capsys.readouterr().err.strip()
        assert code == 2, lines[name]
    assert lines["tp2"] == lines["tp2xcp2"]
    assert lines["tp2"].startswith(
        f"config error: --input={rows}: its longest prompt (line 2, 62 tokens) + rollout.max_new_tokens 5 = 67 "
        "tokens exceed the model's 64 positions (model.max_position_embeddings 64); fix: shorten the prompts to "
        "59 tokens or fewer, lower rollout.max_new_tokens to 2 or less, or enable YaRN"), lines["tp2"]
    assert len(lines["tp2"].splitlines()) == 1 and not (tmp_path / "out.jsonl").exists()


@pytest.mark.slow
def test_generate_runs_prompts_that_fit_the_positions_on_tp2_and_tp2xcp2_alike(tmp_path):
    """3 + 5 tokens fit 64 positions: both layouts generate (not refused for data.max_prompt_tokens'
    default 512, which generate never reads), the same greedy tokens."""
    hf_dir = short_window_model(tmp_path)
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"prompt_ids": [3, 9, 27]}) + "\n" + json.dumps({"prompt_ids": [5, 1]}) + "\n")
    responses = {}
    for name, layout in LAYOUTS.items():
        out = tmp_path / f"{name}.jsonl"
        proc, seconds = cli("generate", "--hf-model", hf_dir, "--input", str(rows), "--output", str(out),
                            *layout, *GREEDY)
        print(f"generate on {name}: {seconds:.1f}s")
        assert proc.returncode == 0, proc.stderr[-3000:]
        generated = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["prompt_ids"] for r in generated] == [[3, 9, 27], [5, 1]]
        responses[name] = [r["response_ids"] for r in generated]
        assert all(1 <= len(r) <= 5 for r in responses[name])
    assert responses["tp2"] == responses["tp2xcp2"]
