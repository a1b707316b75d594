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
    for command in quickstart_commands():
        cmd = command.split("#")[0].strip()
        if cmd.startswith(("./run_ppo.sh", "megatron-rl train")):
            cmd += f" run.dir={tmp_path} trainer.steps=2 trainer.sft_warmup_steps=2"
        proc = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
