#!/usr/bin/env bash
# The README's main job: install if needed, then run the local job on this machine.
# Extra arguments are Hydra overrides, e.g. `bash launch/demo.sh num_steps=50 cluster.nproc=2 parallel.tp=2`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
exec .venv/bin/python -m megatron_rl.train "$@"
