#!/bin/bash
# megatron-rl on GPU nodes only: like slurm/run.sh, but the sandbox servers run as a second
# srun step (--overlap, no GPUs) on the job's CPUs of the GPU nodes, one per node. Use it where
# there is no CPU partition, or for tasks whose rewards need little CPU. Submit (from any directory) with
# Hydra overrides:
#   sbatch slurm/run_gpu_only.sh model=qwen2_5_0_5b task=countdown
# The sandboxes share the job's CPUs on each node with the ranks (cores the job was not given are not its to
# use): ask for more --cpus-per-task than the ranks need, or --exclusive, to give them cores of their own.
# Before submitting: `python -m megatron_rl.slurm_check --script slurm/run_gpu_only.sh [sbatch options]` says whether
# this cluster's nodes can ever run the request (Slurm may leave an impossible one pending for ever).
#SBATCH --job-name=megatron-rl
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=10
#SBATCH --mem=0
# Slurm runs a copy of this script from its spool directory, so the checkout is found from MEGATRON_RL_HOME,
# else the submit directory, else the path this script was submitted as (`scontrol show job`'s Command=).
home=${MEGATRON_RL_HOME:-}
if [[ -z $home ]]; then
  submitted=$(scontrol show job "${SLURM_JOB_ID:-}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n 1)
  [[ -z $submitted || $submitted == /* ]] || submitted=$SLURM_SUBMIT_DIR/$submitted
  for candidate in "${SLURM_SUBMIT_DIR:-}" ${submitted:+"$(dirname "$submitted")/.."} "$(dirname "$0")/.."; do
    if [[ -f $candidate/launch/slurm_job.sh ]]; then home=$(cd "$candidate" && pwd); break; fi
  done
fi
if [[ ! -f ${home:-/nonexistent}/launch/slurm_job.sh ]]; then
  echo "megatron-rl: cannot find the checkout (not ${home:-the submit directory ${SLURM_SUBMIT_DIR:-?}}, not" \
       "where this script was submitted from): set MEGATRON_RL_HOME=/path/to/megatron-rl and resubmit" >&2
  exit 2
fi
export MEGATRON_RL_HOME=$home
exec bash "$home/launch/slurm_job.sh" "$@"
