"""Generated docs are current; the quickstart's commands run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_rl.tools.docs_gen import stale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generated_docs_are_current():
    assert stale() == [], "run: python -m megatron_rl.tools.docs_gen --write"


def quickstart_commands() -> list[str]:
    with open(os.path.join(ROOT, "docs", "quickstart.md")) as fh:
        text = fh.read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_quickstart_shows_the_readme_commands():
    commands = quickstart_commands()
    assert "./run_ppo.sh" in commands
    assert any(c.startswith("megatron-rl plan") for c in commands)


@pytest.mark.slow
def test_every_quickstart_command_runs(tmp_path):
    from megatron_rl.testing.harness import close_all_pools

    close_all_pools()  # the commands start processes of their own; idle test workers would slow them
    env = dict(os.environ, PATH=f"{os.path.join(ROOT, '.venv', 'bin')}:{os.environ['PATH']}")
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"
    commands = [command.split("#")[0].strip() for command in quickstart_commands()]
    jobs = [c for c in commands if c.startswith(("./run_ppo.sh", "megatron-rl train"))]
    # The commands that start no ranks (validate, features, plan) are single processes that mostly
    # import: they run side by side; the training jobs (several ranks each) one after another, each
    # cut to the least the commands allow by overrides: one supervised warm-up step, one RL step on
    # four prompts (the layout, model, launcher and run.name are the command's own).
    light = []
    for i, cmd in enumerate(c for c in commands if c not in jobs):
        out = open(tmp_path / f"light{i}.out", "w+")  # a file, not a pipe: a long output never blocks it
        light.append((cmd, out, subprocess.Popen(cmd, shell=True, cwd=ROOT, env=env, stdout=out, stderr=out)))
    for cmd in jobs:
        cmd += f" run.dir={tmp_path} trainer.steps=1 trainer.sft_warmup_steps=1 trainer.prompts_per_step=4"
        proc = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    for cmd, out, popen in light:
        with out:
            popen.wait(timeout=900)
            out.seek(0)
            assert popen.returncode == 0, f"{cmd}\n{out.read()[-4000:]}"


def _source_text() -> str:
    """The package's source with f-string fields blanked and adjacent literals joined, whitespace collapsed."""
    root = os.path.join(ROOT, "megatron_rl")
    text = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py") and name != "docs_gen.py":
                with open(os.path.join(dirpath, name), encoding="utf-8") as fh:
                    text.append(fh.read())
    joined = re.sub(r'"\s*\n\s*[rf]?"', "", "\n".join(text))
    return " ".join(re.sub(r"\{[^{}]*\}", " ", joined).split())


def test_every_runtime_error_row_names_a_message_the_code_prints():
    """The troubleshooting table is typed by hand: each row's wording (between its placeholders: ``<...>``,
    ``...``, ``N``) must occur in the package's source, so a message that changes or goes away fails here."""
    import megatron_rl.rewards.registry  # noqa: F401 - defines RewardFunctionError
    import megatron_rl.trainer.guards  # noqa: F401 - defines NonFiniteUpdatesError
    from megatron_rl.errors import UserInputError
    from megatron_rl.tools.docs_gen import RUNTIME_ERRORS

    source = _source_text()
    kinds = {cls().one_line().split(":")[0] for cls in _error_classes(UserInputError)}
    placeholder = re.compile(r"<[^>]*>|\.\.\.|\(\.\.\)|\b[NMKS]\b| / |: |\(|\)")
    for message, _, _ in RUNTIME_ERRORS:
        head = message.split(":")[0]
        if head.endswith(" error"):
            assert head in kinds, f"{message!r}: no error class prints {head!r}"
        phrases = [" ".join(f.split()).strip(" :;=,") for f in placeholder.split(message)]
        phrases = [p for p in phrases if len(p) >= 12 and " " in p and not p.endswith(" error")]
        if phrases:
            assert any(p in source for p in phrases), f"{message!r}: none of {phrases} is in the code"


def _error_classes(base):
    out = []
    for cls in base.__subclasses__():
        out.append(lambda cls=cls: cls("k", None, "p", "f"))
        out.extend(_error_classes(cls))
    return out
