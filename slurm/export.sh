#!/bin/bash
# Export a run's training checkpoint as a Hugging Face checkpoint (`python -m megatron_rl.export`,
# docs/checkpoints.md) on one GPU node, one task per GPU started by srun: the weights are read in the
# run's layout, or another one given as overrides (parallel.tp=2 ...). Copy it, edit the #SBATCH lines,
# and submit (from any directory):
#   sbatch slurm/export.sh --run runs/megatron-rl-1234 --checkpoint best --dtype bfloat16
# Output: <run>/hf/<checkpoint name>/ (config.json, safetensors shards, the tokenizer), or --out DIR.
#SBATCH --job-name=megatron-rl-export
#SBATCH --output=%x-%j.out
#SBATCH --time=1:00:00
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
exec bash "$home/launch/slurm_job.sh" --tool export "$@"
