#!/bin/bash
# megatron-rl on a Slurm cluster, the production layout: GPU nodes train and roll out (one SPMD
# srun step, one rank per GPU), the CPU component of this heterogeneous job runs the sandbox
# servers that compute code rewards. Copy it, edit the #SBATCH lines for your cluster
# (docs/cluster.md), and submit from the repository root with Hydra overrides:
#   sbatch slurm/run.sh model=qwen2_5_7b model.path=/ckpt/Qwen2.5-7B task=math parallel.tp=4
# No CPU partition? Use slurm/run_gpu_only.sh (sandboxes on the GPU nodes' spare cores).
# The run directory is runs/<job name>-<job id> (MEGATRON_RL_RUN_ROOT moves it); ~3 min before the
# time limit the job checkpoints, requeues itself and resumes there.
#
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
exec bash "${MEGATRON_RL_HOME:-$SLURM_SUBMIT_DIR}/launch/slurm_job.sh" "$@"
