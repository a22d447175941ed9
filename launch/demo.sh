#!/usr/bin/env bash
# The README's main job: install if needed, then the local demo on this machine: the small
# model and shipped tokenizer, a supervised warm start on Countdown, then GRPO with rewards
# executed by a sandbox server started locally (bubblewrap, installed here when missing).
# Extra arguments are Hydra overrides, e.g. `bash launch/demo.sh num_steps=50`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash launch/setup_env.sh
sandbox=()
if ! bash launch/ensure_bwrap.sh 2>/dev/null; then
  echo "[demo] bubblewrap is missing; the sandbox falls back to the process runtime (NO isolation)" >&2
  sandbox=(sandbox.runtime=process sandbox.allow_unisolated=true)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
exec .venv/bin/python -m megatron_rl.train +experiment=demo_countdown ${sandbox[@]+"${sandbox[@]}"} "$@"
