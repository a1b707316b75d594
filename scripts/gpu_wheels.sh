#!/usr/bin/env bash
# Download, into .whl/, the wheels benchmarks/gpu_check.py needs on a GPU machine that already has
# Python 3.12 and torch with CUDA but no network and no megatron-core.  Run it here (with network);
# .whl/ then travels with the checkout, and on the GPU machine:
#   python -m pip install --no-index --find-links .whl -r .whl/requirements.txt
# pip resolves nothing against torch: torch and triton are the GPU machine's own.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out=.whl
rm -rf "$out" && mkdir -p "$out"
# The pins of requirements-cpu.txt that gpu_check imports, and their own dependencies
# (omegaconf -> pyyaml, megatron-core -> numpy, packaging).  No torch, no test or plot packages.
grep -E '^(megatron-core|omegaconf|psutil|numpy|einops)==' requirements-cpu.txt > "$out/requirements.txt"
cat >> "$out/requirements.txt" <<'REQ'
packaging>=24.2
pyyaml>=6
REQ
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --implementation cp -d "$out" -r "$out/requirements.txt"
du -sh "$out"
ls "$out"
