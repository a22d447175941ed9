#!/usr/bin/env bash
# Test infrastructure for the SGLang integration tier: a separate venv with SGLang 0.5.23 running
# on CPU (see /work/shared/notes/FEASIBILITY.md, "SGLang 0.5.23 on CPU"). SGLang pins a CUDA torch
# and ~4 GB of CUDA wheels; this installs the CPU torch wheel, SGLang's non-CUDA requirements and
# then SGLang itself without dependencies, plus two start-up shims (cpu_shims/):
#   - megatron_rl_sglang_cpu.py (loaded by a .pth file): torchvision op schemas, SGLANG_USE_CPU_ENGINE=1
#   - sgl_kernel/: a stand-in for the kernel package (no CPU wheel) whose functions raise if called
# and points the venv at this checkout of megatron-rl (a .pth file). megatron-rl's own runtime
# requirements (requirements-project.txt: megatron-core, hydra, ...) are added on top, constrained
# to what the venv already holds, so that the RL loop runs there with rollout.backend=sglang.
#
# Knobs: MEGATRON_RL_SGLANG_VENV (default /var/cache/megatron-rl/sglang-venv), PYTHON (default
# python3), SGLANG_TORCH_SPEC (default torch==2.13.0, the CPU wheel).
# Idempotent (stamp files in the venv): ~1.5-5 min the first time on 2 cores (depends on pip's
# cache), well under a second afterwards.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
VENV=${MEGATRON_RL_SGLANG_VENV:-/var/cache/megatron-rl/sglang-venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${SGLANG_TORCH_SPEC:-torch==2.13.0}
SGLANG_SPEC="sglang==0.5.23"
start=$SECONDS

# The heavy part is redone only when what it installs changes.
want="$(cat "$HERE/requirements-cpu.txt" | sha256sum | cut -c1-16) $TORCH_SPEC $SGLANG_SPEC"
stamp="$VENV/.megatron-rl-sglang-installed"
if [[ ! -x "$VENV/bin/python" || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "[sglang-setup] building $VENV ($SGLANG_SPEC on CPU, $TORCH_SPEC); a few minutes the first time" >&2
  rm -f "$stamp" "$VENV/.megatron-rl-sglang-shims"
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  constraint=$(mktemp)
  trap 'rm -f "$constraint"' EXIT
  echo "$TORCH_SPEC" > "$constraint"
  # torch first and pinned, so that nothing below can replace it with a CUDA build.
  "${pip[@]}" "$TORCH_SPEC"
  "${pip[@]}" -r "$HERE/requirements-cpu.txt" -c "$constraint"
  # --no-deps: sglang pins a CUDA torch; PyPI torchvision is a CUDA build (made importable by the
  # shim); torch_memory_saver's hook needs libcuda (its calls are no-ops on CPU).
  "${pip[@]}" --no-deps "$SGLANG_SPEC" "torchvision==0.28.*" "torch_memory_saver==0.0.10"
  echo "$want" > "$stamp"
fi

# megatron-rl's runtime requirements, pinned to everything already installed (pip freeze as the
# constraint): torch stays the CPU wheel and no SGLang pin moves; pip fails instead.
project_want="$(sha256sum < "$HERE/requirements-project.txt" | cut -c1-16) $want"
project_stamp="$VENV/.megatron-rl-project-deps"
if [[ ! -f "$project_stamp" || "$(cat "$project_stamp")" != "$project_want" ]]; then
  echo "[sglang-setup] adding megatron-rl's runtime requirements (requirements-project.txt)" >&2
  rm -f "$VENV/.megatron-rl-sglang-shims"  # re-run the import check below
  frozen=$(mktemp)
  "$VENV/bin/python" -m pip freeze --disable-pip-version-check | grep -v -E '^(-e |megatron-rl)| @ ' > "$frozen"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$HERE/requirements-project.txt" \
    -c "$frozen"
  rm -f "$frozen"
  echo "$project_want" > "$project_stamp"
fi

# The cheap part: shims from this checkout, and this checkout on the venv's path (the tests
# also put their own checkout first on PYTHONPATH). Redone when either changes.
shims_want="$(cd "$HERE" && find cpu_shims -name '*.py' | sort | xargs cat | sha256sum | cut -c1-16) $REPO"
shims_stamp="$VENV/.megatron-rl-sglang-shims"
if [[ ! -f "$shims_stamp" || "$(cat "$shims_stamp")" != "$shims_want" ]]; then
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$VENV/cpu-shims"
  cp -r "$HERE/cpu_shims" "$VENV/cpu-shims"
  find "$VENV/cpu-shims" -name __pycache__ -prune -exec rm -rf {} +
  # A .pth line starting with "import" runs at interpreter start-up (the torchvision hook).
  printf '%s\nimport megatron_rl_sglang_cpu\n' "$VENV/cpu-shims" > "$site/megatron_rl_sglang_cpu.pth"
  printf '%s\n' "$REPO" > "$site/megatron_rl_checkout.pth"
  "$VENV/bin/python" -W ignore - <<'PY'
import importlib.metadata as md
import torch, torchvision, transformers  # noqa: F401  (torchvision exercises the shim)
import sglang  # noqa: F401
import megatron.core, hydra  # noqa: F401  (the RL loop's own requirements)
from megatron_rl.rollout import sglang_engine  # noqa: F401
import megatron_rl.train  # noqa: F401
import megatron_rl_kernels.fused_logprobs, megatron_rl_sandbox.client  # noqa: F401  (the checkout's aliases)
print(f"[sglang-setup] sglang {md.version('sglang')}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, megatron-core {md.version('megatron-core')}", flush=True)
PY
  echo "$shims_want" > "$shims_stamp"
fi
echo "[sglang-setup] $VENV ready ($((SECONDS - start)) s)" >&2
