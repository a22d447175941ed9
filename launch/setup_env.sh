#!/usr/bin/env bash
# Create .venv and install megatron-rl into it (idempotent; a second run takes ~1 s).
#   CPU machine: torch==2.13.0 (the CPU build; no CUDA wheels are downloaded), the package, [dev].
#   GPU machine (nvidia-smi lists a GPU): CUDA torch, the package, [gpu] (Transformer Engine,
#   flash-attn) and [dev].
# Environment knobs: PYTHON (interpreter, default python3), VENV (default .venv),
#   TORCH_SPEC (override the torch requirement), EXTRAS (default "dev"), FORCE_CPU=1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev}

gpu=0
if [[ "${FORCE_CPU:-0}" != 1 ]] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu=1
fi
if [[ $gpu == 1 ]]; then
  TORCH_SPEC=${TORCH_SPEC:-"torch>=2.6"}
  EXTRAS="gpu,$EXTRAS"
else
  TORCH_SPEC=${TORCH_SPEC:-"torch==2.13.0"}
fi

stamp="$VENV/.megatron-rl-installed"
want="$(cat setup.py launch/setup_env.sh | sha256sum | cut -c1-16) $TORCH_SPEC $EXTRAS"
if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "[setup_env] creating $VENV (gpu=$gpu, torch: $TORCH_SPEC, extras: $EXTRAS)" >&2
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: later requirements that admit it then install nothing more.
"${pip[@]}" "$TORCH_SPEC"
if [[ $gpu == 1 ]]; then
  # flash-attn builds against the installed torch and cannot use an isolated build env.
  "${pip[@]}" --no-build-isolation "flash-attn"
fi
"${pip[@]}" -e ".[${EXTRAS}]"
# Editable installs skip build_py, so generate the sandbox's gRPC stubs here (setup.py does it
# for regular installs).
"$VENV/bin/python" -m megatron_rl_sandbox.proto
"$VENV/bin/python" -W ignore - <<'PY'
import megatron.core, torch, transformers, hydra
print(f"[setup_env] torch {torch.__version__} (cuda={torch.cuda.is_available()}), "
      f"megatron-core {megatron.core.__version__}, transformers {transformers.__version__}, "
      f"hydra {hydra.__version__}")
PY
echo "$want" > "$stamp"
