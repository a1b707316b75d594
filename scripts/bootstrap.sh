#!/usr/bin/env bash
# Create (once) and update the project virtualenv at .venv/ with the one tested stack:
# Python 3.12, torch 2.13.0, megatron-core 0.19.2 (requirements-cpu.txt).
# Used by ./run_ppo.sh and `make test`; re-installs only when a requirements file changed.
#   PYTHON=/path/to/python3.12         use this interpreter
#   MEGATRON_RL_EXTRAS=gpu             also installs TransformerEngine (CUDA machines).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

is_py312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  local c
  for c in python3.12 python3 python; do
    if command -v "$c" >/dev/null 2>&1 && is_py312 "$(command -v "$c")"; then command -v "$c"; return; fi
  done
  # Interpreters pyenv (or a similar manager) has installed but not put on PATH, newest first.
  for c in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.* 2>/dev/null | sort -rV); do
    if is_py312 "$c/bin/python"; then echo "$c/bin/python"; return; fi
  done
}

if [ -x .venv/bin/python ] && ! is_py312 .venv/bin/python; then
  echo "bootstrap: .venv has $(.venv/bin/python --version 2>&1), not Python 3.12; recreating it" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  python_bin="$(find_python)"
  if [ -z "$python_bin" ] || ! is_py312 "$python_bin"; then
    echo "bootstrap: no Python 3.12 found (megatron-core 0.19 needs it); fix: install Python 3.12 (e.g. 'pyenv install 3.12' or your OS package python3.12), or set PYTHON=/path/to/python3.12" >&2
    exit 2
  fi
  echo "bootstrap: creating .venv with $("$python_bin" --version) ($python_bin)" >&2
  "$python_bin" -m venv .venv
fi
reqs=(requirements-cpu.txt requirements-test.txt setup.py)
stamp=".venv/.megatron_rl_installed"
want="$(cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)${MEGATRON_RL_EXTRAS:-}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing the pinned stack into .venv (first run: about 3 minutes, 5.1 GB)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-cpu.txt -r requirements-test.txt
  extras="test${MEGATRON_RL_EXTRAS:+,$MEGATRON_RL_EXTRAS}"
  .venv/bin/python -m pip install -q -e ".[${extras}]"
  echo "$want" > "$stamp"
fi
# megatron-core's package_info appends `git rev-parse --short HEAD` of the directory it is installed
# in to its __version__; inside this repository's .venv that is our commit, not megatron's, and
# every import runs git.  NO_VCS_VERSION=1 is its own switch for that (megatron_rl/__init__.py sets it too).
site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo 'import os; os.environ.setdefault("NO_VCS_VERSION", "1")' > "$site/megatron_rl_no_vcs_version.pth"
