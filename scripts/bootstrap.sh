#!/usr/bin/env bash
# Create (once) and update the project virtualenv at .venv/ with the pinned stack.
# Used by ./run_ppo.sh and `make test`; re-installs only when a requirements file changed.
#   MEGATRON_RL_EXTRAS=gpu  also installs TransformerEngine (CUDA machines).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python_bin="$candidate"; break; fi
  done
fi
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($python_bin --version)" >&2
  "$python_bin" -m venv .venv
fi
reqs=(requirements-cpu.txt requirements-test.txt setup.py)
stamp=".venv/.megatron_rl_installed"
want="$(cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)${MEGATRON_RL_EXTRAS:-}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing the pinned stack into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  if .venv/bin/python -c 'import sys; sys.exit(0 if sys.version_info < (3, 12) else 1)'; then
    .venv/bin/python -m pip install -q -r requirements-cpu.txt -r requirements-test.txt
  else
    # megatron-core 0.16.1 is the tested CPU pin; on Python >= 3.12 let pip pick a compatible release.
    .venv/bin/python -m pip install -q -r requirements-test.txt
  fi
  extras="test${MEGATRON_RL_EXTRAS:+,$MEGATRON_RL_EXTRAS}"
  .venv/bin/python -m pip install -q -e ".[${extras}]"
  echo "$want" > "$stamp"
fi
