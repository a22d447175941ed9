#!/bin/bash
# megatron-rl on a Slurm cluster, the production layout: GPU nodes train and roll out (one SPMD
# srun step, one rank per GPU), the CPU component of this heterogeneous job runs the sandbox
# servers that compute code rewards. Copy it, edit the #SBATCH lines for your cluster
# (docs/cluster.md), and submit (from any directory) with Hydra overrides:
#   sbatch slurm/run.sh +experiment=qwen3_8b_code model.path=/ckpt/Qwen3-8B task.path=/data/code.jsonl
# No CPU partition? Use slurm/run_gpu_only.sh (sandboxes on the GPU nodes' CPUs).
# The run directory is runs/<job name>-<job id> (MEGATRON_RL_RUN_ROOT moves it); before the time
# limit (after the last step that leaves time for another and its checkpoint; USR1 below is the backstop) the
# job checkpoints, requeues itself and resumes there.
#
# Before submitting: `python -m megatron_rl.slurm_check --script slurm/run.sh [sbatch options]` says whether
# this cluster's nodes can ever run the request (Slurm may leave an impossible one pending for ever).
# Component 0: GPU nodes. Job-wide options (time, output, requeue, signal) go here too.
#SBATCH --job-name=megatron-rl
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@180
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH hetjob
# Component 1: CPU node(s), one sandbox server per node using all its cores.
#SBATCH --partition=cpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --mem=64G
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
