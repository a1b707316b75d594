"""Exporting and evaluating what a run made: ``convert`` writes the tokenizer, chat template and
generation config the run used; ``convert``/``generate`` take a run directory for its newest
checkpoint; ``generate`` reads its own output and needs no tokenizer for rows of ids; bad paths
stop in one line before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.testing.harness import get_pool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = [{"role": "system", "content": "add"}, {"role": "user", "content": "what is 12+30?"}]
# A template unlike the built-in "role: content" fallback, with its own special tokens.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GENERATION = dict(bos_token_id=2, eos_token_id=[1, 5], pad_token_id=0, do_sample=True, temperature=0.7, top_p=0.9)
RUN = ["data.train_path=task:add_small", "data.max_prompt_tokens=48", "reward.fn=tests.support.helpers:digit_share",
       "rollout.n=2", "rollout.max_new_tokens=3", "trainer.prompts_per_step=2", "trainer.plot=false",
       "batch.micro_batch_size=2", "algorithm.mini_batches=1", "trainer.steps=1"]


def cli(*args, timeout=600):
    """The CLI as its own process, forked from one with the imports done (no interpreter start each)."""
    from megatron_rl.testing.cli_runner import run_cli

    return run_cli(*args, env=dict(os.environ), cwd=ROOT, timeout=timeout)


def save_chat_tokenizer(path: str):
    """A character-level HF tokenizer (fits the tiny models' 250 ids) with a chat template, saved
    by transformers itself: ``chat_template.jinja`` under transformers 5."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<|system|>", "<|user|>",
                                         "<|assistant|>"])}
    for ch in string.digits + string.ascii_lowercase + " +-*/=#.,:?()\n":
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"]})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)


def chat_ids(tokenizer_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return list(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A one-step run from a tiny HF model (no tokenizer of its own, a generation_config.json) with
    a separate chat tokenizer (``data.tokenizer``); a later save that never finished lies beside
    its checkpoint."""
    from transformers import GenerationConfig

    from tests.support.helpers import make_hf_model

    root = tmp_path_factory.mktemp("chat_run")
    model_dir, tok_dir = str(root / "model"), str(root / "tok")
    make_hf_model("llama", model_dir)
    GenerationConfig(**GENERATION).save_pretrained(model_dir)
    save_chat_tokenizer(tok_dir)
    assert os.path.isfile(os.path.join(tok_dir, "chat_template.jinja"))
    proc = cli("train", "--nproc", "1", f"model.hf_path={model_dir}", f"data.tokenizer={tok_dir}", *RUN,
               f"run.dir={root / 'runs'}", "run.name=r")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = root / "runs" / "r"
    (run / "checkpoints" / "step_00000002" / "actor").mkdir(parents=True)  # a save that did not finish
    return run, model_dir, tok_dir


def test_export_of_a_run_carries_its_tokenizer_chat_template_and_generation_config(chat_run, tmp_path):
    run, model_dir, tok_dir = chat_run
    out = tmp_path / "hf"
    proc = cli("convert", "--checkpoint", str(run), "--hf-out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = run / "checkpoints" / "step_00000001"
    assert f"using {step}, the newest complete checkpoint" in proc.stdout, proc.stdout
    assert (out / "chat_template.jinja").is_file()
    source_ids = chat_ids(tok_dir)
    assert chat_ids(str(out)) == source_ids
    # The project's own tokenizer on the export renders the template, not the plain fallback.
    from megatron_rl.data.tokenizer import HFTokenizer

    assert HFTokenizer(str(out)).apply_chat_template(CHAT) == source_ids
    assert HFTokenizer(str(out)).apply_chat_template(CHAT) != HFTokenizer(str(out)).encode_prompt(
        "system: add\nuser: what is 12+30?\nassistant: ")
    with open(os.path.join(model_dir, "generation_config.json")) as a, open(out / "generation_config.json") as b:
        assert json.load(a) == json.load(b)
    print(f"chat prompt: {len(source_ids)} tokens, same ids from the export")


def test_generate_reads_the_newest_checkpoint_under_checkpoints_with_the_runs_tokenizer(chat_run, tmp_path):
    run, _, tok_dir = chat_run
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"messages": CHAT}) + "\n")
    out = tmp_path / "out.jsonl"
    proc = cli("generate", "--checkpoint", str(run / "checkpoints"), "--input", str(rows), "--output", str(out),
               "rollout.n=1", "rollout.max_new_tokens=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"using {run / 'checkpoints' / 'step_00000001'}, the newest complete checkpoint" in proc.stdout
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["prompt_ids"] == chat_ids(tok_dir)


def _fake_checkpoint(path, **meta):
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"complete": True, "format": 1, "step": int(path.name[5:]),
                                                "files": {}, "checksums": {}, "parts": [], "models": {"actor": {}},
                                                **meta}))


def test_a_run_or_its_checkpoints_directory_resolves_to_the_newest_complete_step(tmp_path):
    from megatron_rl.engine.checkpoint import check_checkpoint, resolve_checkpoint
    from megatron_rl.errors import CheckpointError

    ckpts = tmp_path / "runs" / "r" / "checkpoints"
    _fake_checkpoint(ckpts / "step_00000001")
    _fake_checkpoint(ckpts / "step_00000002")
    (ckpts / "step_00000003").mkdir()  # interrupted save
    newest = str(ckpts / "step_00000002")
    assert resolve_checkpoint(str(tmp_path / "runs" / "r")) == newest
    assert resolve_checkpoint(str(ckpts)) == newest
    assert resolve_checkpoint(str(ckpts / "step_00000001")) == str(ckpts / "step_00000001")
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        check_checkpoint(resolve_checkpoint(str(ckpts / "step_00000003")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"not a checkpoint \(no meta.json here\); fix: give a step_XXXXXXXX "
                                              r"directory, a run's checkpoints/"):
        check_checkpoint(resolve_checkpoint(str(tmp_path / "empty")))
    only_broken = tmp_path / "broken" / "checkpoints" / "step_00000001"
    only_broken.mkdir(parents=True)
    with pytest.raises(CheckpointError, match="none of the checkpoints under .* is complete"):
        resolve_checkpoint(str(tmp_path / "broken"))


# ----------------------------------------------------------------------------- generate's rows


def generate_body(hf_dir: str, input_path: str, output: str, overrides: list[str]):
    from megatron_rl.config.loader import load_config
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.tools.generate import run_generate

    cfg = load_config(None, overrides)
    cfg.model = model_config_from_hf(read_hf_config(hf_dir), cfg.model)
    cfg.model.hf_path = hf_dir
    return run_generate(cfg, input_path, output, hf_dir=hf_dir)


def read_rows(path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def test_generate_output_is_read_back_as_input(tmp_path):
    """One name both ways (``prompt_ids``); ``input_ids``, the name read before, still reads."""
    from tests.support.helpers import make_hf_model

    hf_dir = str(tmp_path / "hf")
    make_hf_model("llama", hf_dir)
    first = tmp_path / "in.jsonl"
    first.write_text(json.dumps({"input_ids": [3, 9, 27]}) + "\n" + json.dumps({"prompt_ids": [5, 1]}) + "\n")
    greedy = ["data.tokenizer=char", "rollout.n=2", "rollout.max_new_tokens=4", "rollout.temperature=0"]
    get_pool(1).run(generate_body, hf_dir, str(first), str(tmp_path / "out1.jsonl"), greedy)
    get_pool(1).run(generate_body, hf_dir, str(tmp_path / "out1.jsonl"), str(tmp_path / "out2.jsonl"), greedy)
    once, again = read_rows(tmp_path / "out1.jsonl"), read_rows(tmp_path / "out2.jsonl")
    assert [r["prompt_ids"] for r in once] == [[3, 9, 27]] * 2 + [[5, 1]] * 2
    assert [r["prompt_ids"] for r in again] == [p for r in once for p in [r["prompt_ids"]] * 2]
    assert [r["response_ids"] for r in again] == [r["response_ids"] for r in once for _ in range(2)]


def test_generate_from_ids_with_a_model_saved_without_tokenizer(tmp_path):
    from tests.support.helpers import make_hf_model

    hf_dir = tmp_path / "hf"
    make_hf_model("llama", str(hf_dir))
    assert sorted(os.listdir(hf_dir)) == ["config.json", "generation_config.json", "model.safetensors"]
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"prompt_ids": [3, 9, 27]}) + "\n")
    out = tmp_path / "out.jsonl"
    proc = cli("generate", "--hf-model", str(hf_dir), "--input", str(rows), "--output", str(out),
               "rollout.n=1", "rollout.max_new_tokens=3", "rollout.temperature=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_rows(out)
    assert row["prompt_ids"] == [3, 9, 27] and len(row["response_ids"]) == len(row["logprobs"]) >= 1
    assert row["text"] is None
    # The reference: HF transformers, in a process of its own (late in a long test process HF's
    # numbers have drifted before; see hf_logprobs_in_a_fresh_process).  Every response token is
    # HF's argmax after the same prefix, up to a tie within 1e-5 of a random tiny model's logits.
    margins = _hf_greedy_margins(str(hf_dir), [3, 9, 27], row["response_ids"])
    assert max(margins) < 1e-5, margins
    text_rows = tmp_path / "text.jsonl"
    text_rows.write_text(json.dumps({"prompt": "hi"}) + "\n")
    proc = cli("generate", "--hf-model", str(hf_dir), "--input", str(text_rows), "--output", str(out))
    assert proc.returncode == 2
    assert "'prompt' needs a tokenizer and the model directory holds none" in proc.stderr


# ----------------------------------------------------------------------------- bad paths

# Runs each case's command line through the CLI's main() in this one process (imports paid once),
# with starting ranks (locally, or this process as a rank) made to fail loudly; one JSON line per
# case on stdout: exit code, stderr, seconds.
GUARD = """
import contextlib, io, json, sys, time
import megatron_rl.distributed.launcher as launcher
import megatron_rl.tools.cli as cli
import megatron_rl.engine.checkpoint  # imported once, before the clock: torch, megatron-core

def started(*args, **kwargs):
    print("RANKS STARTED", file=sys.stderr)
    return 99

cli._rank_main = launcher.launch_local = started
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err):
        code = cli.main(argv)
    print(json.dumps({"code": code, "stderr": err.getvalue(), "seconds": time.monotonic() - start}), flush=True)
"""


def test_bad_tool_paths_exit_2_in_one_line_before_any_rank_starts(tmp_path):
    """Every bad path of score, generate and convert: one line naming the flag and the fix, exit
    code 2, within seconds and before the local launcher or a rank's work could start."""
    from tests.support.helpers import make_hf_model

    hf = tmp_path / "hf"
    make_hf_model("llama", str(hf))  # a model the config accepts: only the bad path can stop the command
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"prompt_ids": [1, 2]}\n')
    ckpt = tmp_path / "ckpt" / "step_00000000"
    _fake_checkpoint(ckpt, hf_config={})
    used = tmp_path / "used"
    used.mkdir()
    (used / "config.json").write_text("{}")
    missing = str(tmp_path / "missing")
    cases = {
        "score --hf-model": (["score", "--hf-model", missing, "--input", str(rows), "--output", "o"],
                             "config error: --hf-model="),
        "score --input": (["score", "--hf-model", str(hf), "--input", missing, "--output", "o"],
                          "data error: --input="),
        "score --output": (["score", "--hf-model", str(hf), "--input", str(rows), "--output", f"{missing}/o.jsonl"],
                           "storage error: --output="),
        "generate --checkpoint": (["generate", "--checkpoint", missing, "--input", str(rows), "--output", "o"],
                                  "checkpoint error: --checkpoint="),
        "generate --input": (["generate", "--hf-model", str(hf), "--input", missing, "--output", "o"],
                             "data error: --input="),
        "generate --output": (["generate", "--hf-model", str(hf), "--input", str(rows), "--output", str(hf)],
                              "storage error: --output="),
        "generate --part": (["generate", "--checkpoint", str(ckpt), "--part", "critic", "--input", str(rows),
                             "--output", "o"], "checkpoint error: --part=critic"),
        "convert --checkpoint": (["convert", "--checkpoint", missing, "--hf-out", str(tmp_path / "new")],
                                 "checkpoint error: --checkpoint="),
        "convert --hf-out": (["convert", "--checkpoint", str(ckpt), "--hf-out", str(used)],
                             "storage error: --hf-out="),
        "convert --hf-model": (["convert", "--hf-model", missing, "--out", str(tmp_path / "new")],
                               "config error: --hf-model="),
        "convert --out": (["convert", "--hf-model", str(hf), "--out", str(ckpt.parent)], "checkpoint error: --out="),
    }
    argvs = [args + ["--nproc", "2"] for args, _ in cases.values()]
    proc = subprocess.run([sys.executable, "-c", GUARD, json.dumps(argvs)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), proc.stdout
    failures = []
    for (name, (_, head)), got in zip(cases.items(), results):
        lines = [ln for ln in got["stderr"].splitlines() if ln.strip()]
        print(f"{name}: exit {got['code']} in {got['seconds']:.2f}s: {lines[-1] if lines else ''}")
        if got["code"] != 2 or len(lines) != 1 or not lines[0].startswith(head) or "fix: " not in lines[0] \
                or got["seconds"] > 5:
            failures.append(f"{name}: exit {got['code']} in {got['seconds']:.1f}s, stderr {got['stderr'][-500:]!r}")
    assert not failures, "\n".join(failures)


def test_readme_lists_every_command():
    from megatron_rl.tools.cli import _parser

    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    with open(os.path.join(ROOT, "README.md")) as fh:
        listed = {line.split()[1] for line in fh if line.startswith("megatron-rl ")}
    assert sorted(set(commands) - listed) == []


def _hf_greedy_margins(hf_dir: str, prompt: list[int], response: list[int]) -> list[float]:
    """Per response token: HF's best log-prob at that position minus the token's own (0 when the
    token is HF's argmax), computed in a fresh process."""
    code = ("import json, sys, torch, transformers\n"
            "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
            "prompt, response = json.loads(sys.argv[2]), json.loads(sys.argv[3])\n"
            "with torch.no_grad():\n"
            "    logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].float(), -1)\n"
            "rows = logp[len(prompt) - 1:-1]\n"
            "print(json.dumps([float(r.max() - r[t]) for r, t in zip(rows, response)]))\n")
    proc = subprocess.run([sys.executable, "-c", code, hf_dir, json.dumps(prompt), json.dumps(response)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])
