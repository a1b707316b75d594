#!/usr/bin/env bash
# Submit N jobs of scripts/slurm/ppo.sbatch that run one after another, for a run longer than
# the partition's time limit.  Each job starts when the previous one has ended for any reason
# (afterany): it resumes from the latest checkpoint (trainer.resume=auto), and a job that finds
# the run already finished exits 0 after start-up without training.  A job that is preempted
# and requeues itself has not ended: the next one waits until its restarted run ends.
#
#   scripts/slurm/submit_chain.sh 5 -N 4 --gpus-per-node=8 -t 4:00:00
#   CONFIG=configs/x.yaml RUN_NAME=exp1 scripts/slurm/submit_chain.sh 3 -N 2 -- key=value ...
#
# Arguments after N go to every sbatch; after a `--`, to the script (config overrides).
# SCRIPT=path chooses another batch script.  Prints one job id per line, first job first.
# The knobs (CONFIG, RUN_NAME, ...) travel in the environment, so every job gets the same ones;
# set RUN_NAME (or run.name in the config) so every link writes the same run directory.
set -euo pipefail

usage() { echo "usage: $0 N [sbatch args...] [-- script args...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
count="$1"; shift
[[ "$count" =~ ^[1-9][0-9]*$ ]] || usage
script="${SCRIPT:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ppo.sbatch}"

sbatch_args=()
script_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; script_args=("$@"); break; fi
  sbatch_args+=("$1"); shift
done

prev=""
for _ in $(seq "$count"); do
  dep=()
  [ -n "$prev" ] && dep=(--dependency="afterany:$prev")
  out="$(sbatch --parsable "${dep[@]}" "${sbatch_args[@]}" "$script" "${script_args[@]}")"
  prev="${out%%;*}"   # --parsable prints "jobid" or "jobid;cluster"
  echo "$prev"
done
