#!/usr/bin/env bash
# Create .venv and install megatron-rl into it (idempotent; a second run takes ~1 s).
#   bash launch/setup_env.sh         CPU or GPU environment by this machine: GPU when nvidia-smi lists a GPU,
#                                    or when the venv was built with --gpu (a node without a GPU keeps it)
#   bash launch/setup_env.sh --gpu   the GPU environment, also where no GPU is visible (a login node whose
#                                    file system the GPU nodes share)
#   bash launch/setup_env.sh --cpu   the CPU environment (as FORCE_CPU=1)
# CPU: torch==2.13.0 (the CPU build; no CUDA wheels are downloaded), the package, [dev].
# GPU: the versions in launch/gpu-constraints.txt (CUDA 13 torch, Transformer Engine, SGLang with flash-attn-4;
#   Python >= 3.11): torch first, then Transformer Engine's torch extension (a prebuilt wheel when its build finds
#   one for this torch, else compiled against it), then the package with [sglang,dev].
# Environment knobs: PYTHON (interpreter, default python3), VENV (default .venv),
#   TORCH_SPEC (the CPU path's torch requirement), EXTRAS (default "dev"), FORCE_CPU=1.
#   GPU only: GPU_CONSTRAINTS (another pin file), FLASH_ATTN_WHEEL=<file or URL> (add a flash-attn 2.x wheel built
#   for the pinned torch), MAX_JOBS (parallel compile jobs of the Transformer Engine build).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=auto
for arg in "$@"; do
  case $arg in
    --gpu) mode=gpu ;;
    --cpu) mode=cpu ;;
    *) echo "[setup_env] unknown argument '$arg'; usage: bash launch/setup_env.sh [--gpu|--cpu]" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-dev}
PINS=${GPU_CONSTRAINTS:-launch/gpu-constraints.txt}
stamp="$VENV/.megatron-rl-installed"

gpu=0
if [[ $mode == gpu ]]; then
  gpu=1
elif [[ $mode == auto && "${FORCE_CPU:-0}" != 1 ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu=1
  elif [[ -f "$stamp" && "$(cut -d' ' -f1 "$stamp")" == gpu ]]; then
    # Built with --gpu (maybe on this node): installing the CPU torch over it would break every GPU job.
    gpu=1
  fi
fi
if [[ $gpu == 1 ]]; then
  [[ -z "${TORCH_SPEC:-}" ]] || { echo "[setup_env] TORCH_SPEC applies to the CPU environment; the GPU" \
    "environment's torch is pinned in $PINS (GPU_CONSTRAINTS=<file> for another set)" >&2; exit 2; }
  [[ -f "$PINS" ]] || { echo "[setup_env] no pin file $PINS" >&2; exit 2; }
  TORCH_SPEC=$(grep -E '^torch==' "$PINS")
  EXTRAS="sglang,$EXTRAS"
  want="gpu $(cat setup.py launch/setup_env.sh "$PINS" | sha256sum | cut -c1-16) $EXTRAS ${FLASH_ATTN_WHEEL:-}"
else
  TORCH_SPEC=${TORCH_SPEC:-"torch==2.13.0"}
  want="cpu $(cat setup.py launch/setup_env.sh | sha256sum | cut -c1-16) $TORCH_SPEC $EXTRAS"
fi

if [[ -x "$VENV/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "[setup_env] creating $VENV (gpu=$gpu, torch: $TORCH_SPEC, extras: $EXTRAS)" >&2
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
py="$VENV/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
if [[ $gpu == 0 ]]; then
  # torch first and pinned: later requirements that admit it then install nothing more.
  "${pip[@]}" "$TORCH_SPEC"
  "${pip[@]}" -e ".[${EXTRAS}]"
else
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "[setup_env] the GPU environment needs" \
    "Python >= 3.11 (sglang 0.5.23), $VENV has $("$py" -V): PYTHON=python3.11 (or 3.12) with a new VENV" >&2; exit 2; }
  gpip=("${pip[@]}" -c "$PINS")
  "${gpip[@]}" torch torchvision triton
  if ! "$py" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
    echo "[setup_env] $VENV holds torch $("$py" -c 'import torch; print(torch.__version__)'), a CPU build (a venv" \
      "made by the CPU path, or a CPU index in pip's configuration), and pip keeps it: remove the venv" \
      "(rm -rf $VENV) or name another (VENV=...), then run 'bash launch/setup_env.sh --gpu' again" >&2
    exit 1
  fi
  # What the build below imports (it compiles against this torch, so without build isolation), and the CUDA
  # headers that torch's CUDA wheels leave out (crt/, cccl).
  "${gpip[@]}" setuptools wheel packaging ninja einops nvidia-cudnn-frontend transformer-engine-cu13 \
    "cuda-toolkit[crt,cccl]"
  # Transformer Engine's torch extension is source only: its build fetches a prebuilt wheel from TE's GitHub
  # release when one matches this torch (NVTE_PYTORCH_FORCE_BUILD=TRUE skips that), else compiles C++ only
  # (about 15 CPU-minutes). Against the CUDA headers of the wheels torch brought, so that they are torch's CUDA release
  # whatever CUDA module is loaded (NVTE_BUILD_USE_NVIDIA_WHEELS=0: those of $CUDA_HOME or of nvcc's directory).
  NVTE_BUILD_USE_NVIDIA_WHEELS=${NVTE_BUILD_USE_NVIDIA_WHEELS:-1} \
    "${gpip[@]}" --no-build-isolation "transformer-engine[pytorch]"
  if [[ -n "${FLASH_ATTN_WHEEL:-}" ]]; then
    "${gpip[@]}" "$FLASH_ATTN_WHEEL"  # flash-attn 2.x, built for this torch (docs/install.md#flash-attn)
  fi
  "${gpip[@]}" -e ".[${EXTRAS}]"
  if [[ -n "${FLASH_ATTN_WHEEL:-}" ]]; then
    # flash-attn 2.x carries an older copy of flash-attn-4's files (flash_attn/cute/): flash-attn-4's must win.
    "${gpip[@]}" --force-reinstall --no-deps flash-attn-4
  fi
fi
# Editable installs skip build_py, so generate the sandbox's gRPC stubs here (setup.py does it
# for regular installs).
"$py" -m megatron_rl_sandbox.proto
if [[ $gpu == 1 ]]; then
  PINS=$PINS "$py" -W ignore - <<'PY'
import importlib.metadata as md, os, re, shutil, subprocess
from packaging.version import Version
# Every pinned package that is installed has its pinned version (a pip step that ignored a pin would show here).
pins = dict(re.match(r"([\w.-]+)==(\S+)", line).groups() for line in open(os.environ["PINS"])
            if re.match(r"[\w.-]+==", line))
wrong = []
for name, version in pins.items():
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        continue
    if Version(Version(have).public) != Version(version):
        wrong.append(f"{name} {have} (pinned {version})")
if wrong:
    raise SystemExit("[setup_env] not the pinned versions: " + ", ".join(wrong))
import torch, megatron.core, transformers, hydra  # noqa: F401
import megatron_rl_kernels.triton_logprobs  # noqa: F401  (the project's Triton kernels, with the installed triton)
try:
    flash_attn = f"flash-attn {md.version('flash-attn')}, "
except md.PackageNotFoundError:
    flash_attn = ""
print(f"[setup_env] torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
      f"megatron-core {megatron.core.__version__}, transformers {transformers.__version__}, "
      f"sglang {md.version('sglang')}, Transformer Engine {md.version('transformer-engine')}, {flash_attn}"
      f"flash-attn-4 {md.version('flash-attn-4')}")
if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
    import transformer_engine.pytorch, sglang  # noqa: F401  (need a GPU driver to load)
    print(f"[setup_env] GPU: {torch.cuda.get_device_name()}; transformer_engine.pytorch and sglang import")
else:
    print("[setup_env] no GPU visible here: Transformer Engine and SGLang were installed but not imported")
PY
else
  "$py" -W ignore - <<'PY'
import megatron.core, torch, transformers, hydra
print(f"[setup_env] torch {torch.__version__} (cuda={torch.cuda.is_available()}), "
      f"megatron-core {megatron.core.__version__}, transformers {transformers.__version__}, "
      f"hydra {hydra.__version__}")
PY
fi
echo "$want" > "$stamp"
