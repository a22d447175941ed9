#!/usr/bin/env bash
# The body of slurm/run.sh and slurm/run_gpu_only.sh (and, with --tool eval|export first, of slurm/eval.sh
# and slurm/export.sh: `srun python -m megatron_rl.<tool> <args>`): runs in the batch step of the allocation.
# Finds the checkout and its .venv, then hands over to `python -m megatron_rl.slurm_job run`
# (exec: the batch step's signals, e.g. `--signal=B:USR1@120`, reach Python directly), which
# starts the sandbox servers and the training step, requeues on USR1 and names a failed rank.
# Environment knobs:
#   MEGATRON_RL_HOME       the checkout (default: $SLURM_SUBMIT_DIR, i.e. submit from the repo root)
#   PYTHON                 interpreter (default: $MEGATRON_RL_HOME/.venv/bin/python)
#   MEGATRON_RL_RUN_ROOT   where run directories go (default: $SLURM_SUBMIT_DIR/runs; a relative one is taken
#                          from $SLURM_SUBMIT_DIR); each job gets <root>/<job name>-<job id> unless run_dir=...
#                          is an override (relative paths in overrides are the submit directory's too)
#   MEGATRON_RL_SANDBOX    none = start no sandbox servers (none start anyway for a task whose rewards run no
#                          code, or with sandbox.address)
#   SANDBOX_SERVER_ARGS    extra arguments for each sandbox server, e.g. "--max-sessions=64" (images: the
#                          config's sandbox.images)
set -euo pipefail
HOME_DIR=${MEGATRON_RL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
if [[ ! -f "$HOME_DIR/megatron_rl/slurm_job.py" ]]; then
  echo "megatron-rl: $HOME_DIR is not a megatron-rl checkout; submit from the repository root or set" \
       "MEGATRON_RL_HOME=/path/to/megatron-rl (sbatch passes your environment to the job)" >&2
  exit 2
fi
PY=${PYTHON:-$HOME_DIR/.venv/bin/python}
if [[ ! -x "$PY" ]]; then
  echo "megatron-rl: no interpreter at $PY; run 'bash launch/setup_env.sh' on a node first or set PYTHON=" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
if [[ "${1:-}" == --tool ]]; then  # slurm/eval.sh, slurm/export.sh: one srun step, a rank per task of the job
  cd "${SLURM_SUBMIT_DIR:-$PWD}"  # paths on the command line (--run runs/...) are the submitter's
  tool=$2
  shift 2
  cpus=()  # srun of Slurm 22.05 to 23.02 does not inherit --cpus-per-task
  [[ -n "${SLURM_CPUS_PER_TASK:-}" ]] && cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
  exec srun --kill-on-bad-exit=1 --label --mem=0 --job-name="$tool" ${cpus[@]+"${cpus[@]}"} \
    "$PY" -m "megatron_rl.$tool" "$@"
fi
# The batch step and the ranks run in the submit directory, so that relative paths in the overrides
# (run_dir=runs/..., task.path=data/...) mean what they mean in a local run there; the checkout stays first on
# sys.path (as the working directory was), so MEGATRON_RL_HOME's code runs whatever the venv has installed.
cd "${SLURM_SUBMIT_DIR:-$PWD}"
export PYTHONPATH="$HOME_DIR${PYTHONPATH:+:$PYTHONPATH}"
args=()
[[ "${MEGATRON_RL_SANDBOX:-}" == none ]] && args+=(--no-sandbox)
read -r -a extra <<< "${SANDBOX_SERVER_ARGS:-}"  # split on spaces, no glob expansion
for a in ${extra[@]+"${extra[@]}"}; do args+=("--server-arg=$a"); done
# ${x[@]+"${x[@]}"}: an empty array under `set -u` is an error in bash < 4.4 (EL7)
exec "$PY" -m megatron_rl.slurm_job run ${args[@]+"${args[@]}"} -- "$@"
