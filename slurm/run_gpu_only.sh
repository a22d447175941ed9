#!/bin/bash
# megatron-rl on GPU nodes only: like slurm/run.sh, but the sandbox servers run as a second
# srun step (--overlap, no GPUs) on the spare cores of the GPU nodes, one per node. Use it where
# there is no CPU partition, or for tasks whose rewards need little CPU. Submit from the
# repository root with Hydra overrides:
#   sbatch slurm/run_gpu_only.sh model=qwen2_5_0_5b task=countdown
# Leave cores for the sandboxes: --cpus-per-task times --ntasks-per-node below the node's cores.
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
exec bash "${MEGATRON_RL_HOME:-$SLURM_SUBMIT_DIR}/launch/slurm_job.sh" "$@"
