#!/usr/bin/env bash
# One prepared run of every GPU measurement, sized to finish within ~8 minutes on one H200
# (issue 10): kernel correctness, speed-up and memory, training-step tokens/s and MFU for a ~1B model,
# weight-sync GB/s, offload/onload GB/s and real memory release, packed rows on the TE spec.
# Each part has its own timeout so one slow part cannot eat the others' time; results go to
# $OUT (or ./gpu-results).
#
#   bash tests/gpu/run_h200.sh          # on the GPU machine, from the repository root
#
# Needs the GPU environment: `bash launch/setup_env.sh --gpu` (the pinned CUDA torch, triton, TE, flash-attn,
# SGLang; docs/install.md). On a machine without a network whose
# python already has torch, triton and transformers: WHEELS=<folder of the other wheels (megatron-core,
# hydra-core, omegaconf, antlr4-python3-runtime)> PYTHON=python3 installs those into /tmp/site and maps the
# checkout's packages there. Without Transformer Engine the model parts run Megatron's local spec
# (model.transformer_impl=local; the TE-only tests skip) and every figure says which spec it came from.
# PARTS="kernel_bench train_step" runs only the parts named. The wheels for a Python 3.12 machine, made where pip
# works (antlr4-python3-runtime is published as source only, hence `pip wheel`):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1 hydra-core==1.3.8 omegaconf==2.3.1
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1
if [[ -n "${WHEELS:-}" ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
  ln -sfn "$PWD/kernels/megatron_rl_kernels" /tmp/site/megatron_rl_kernels
  ln -sfn "$PWD/sandbox" /tmp/site/megatron_rl_sandbox
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" - >> "$OUT/gpu.txt" 2>&1 <<'PY'
import torch, transformers, megatron.core
from megatron_rl.models.gpt import te_available
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "missing"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, transformers {transformers.__version__}, "
      f"megatron-core {megatron.core.__version__}, Transformer Engine {'yes' if te_available() else 'no'}, "
      f"{torch.cuda.get_device_name()}")
PY
cat "$OUT/gpu.txt"
IMPL=auto
"$PY" -c "from megatron_rl.models.gpt import te_available; raise SystemExit(0 if te_available() else 1)" || IMPL=local
part() {  # name, timeout seconds, command...; PARTS="name ..." runs only those
  local name=$1 limit=$2; shift 2
  [[ -z "${PARTS:-}" || " $PARTS " == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s)" | tee -a "$OUT/summary.txt"
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "Warning\|warnings.warn" "$OUT/$name.log" | tail -n 14 | tee -a "$OUT/summary.txt"
  echo "-- $name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}
part kernel_tests 75 "$PY" -m pytest tests/gpu/test_fused_logprobs_gpu.py -q -s -p no:cacheprovider -p no:warnings
part kernel_bench 110 "$PY" benchmarks/logprob_kernel.py --device cuda --dtype bfloat16 --threads 16 \
  --sizes 8192x150000x4096 16384x152064x2048 --max-naive-gb 60
# ~1.3B parameters: Llama-3 attention layout (32 heads, 8 KV groups, 128k vocabulary), 2048 hidden, 16 layers.
part train_step 150 "$PY" benchmarks/train_step.py --model llama3_8b --device cuda --samples 16 --length 2048 \
  --micro-batch-tokens 8192 --steps 5 --hidden 2048 --layers 16 --peak-tflops 989 --transformer-impl $IMPL
part weight_sync 60 "$PY" benchmarks/weight_sync.py --model qwen2_5_0_5b --device cuda --dtype bfloat16 \
  --repeats 5 --transformer-impl $IMPL
part colocation 80 "$PY" -m pytest tests/gpu/test_colocation_gpu.py -q -s -p no:cacheprovider -p no:warnings
# Packed rows on the Transformer Engine spec (THD attention keeps samples apart); LoRA with its fused norms.
part packed_attention 60 "$PY" -m pytest tests/gpu/test_packed_attention_gpu.py tests/gpu/test_lora_gpu.py -q -s \
  -p no:cacheprovider -p no:warnings
echo "results in $OUT/summary.txt"
