#!/usr/bin/env bash
# The front door.  Sets up .venv on first use, then runs the main job:
#   ./run_ppo.sh                       # no GPU: the embedded CPU demo on local gloo ranks
#   ./run_ppo.sh key=value ...         # with config overrides
#   CONFIG=configs/x.yaml NPROC=8 ./run_ppo.sh
# On a GPU machine it starts one rank per GPU with torchrun.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"
./scripts/bootstrap.sh
py=.venv/bin/python
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus="${NPROC:-$(nvidia-smi -L | wc -l)}"
  config="${CONFIG:-configs/qwen2.5_1.5b_8k.yaml}"
  exec .venv/bin/torchrun --standalone --nproc-per-node "$gpus" -m megatron_rl.tools.cli train --config "$config" "$@"
fi
config="${CONFIG:-configs/demo_cpu.yaml}"
exec "$py" -m megatron_rl.tools.cli train --config "$config" ${NPROC:+--nproc "$NPROC"} "$@"
