#!/usr/bin/env bash
# One prepared run of every GPU measurement, sized to finish within ~8 minutes on one H200
# (issue 10): kernel speed-up and memory, training-step tokens/s and MFU for a ~1B model,
# weight-sync GB/s, offload/onload GB/s and real memory release, packed rows on the TE spec.
# Each part has its own timeout so one slow part cannot eat the others' time; results go to
# $OUT (or ./gpu-results).
#
#   bash tests/gpu/run_h200.sh          # on the GPU machine, from the repository root
#
# Needs the GPU environment: `bash launch/setup_env.sh` on the GPU machine (CUDA torch, TE,
# flash-attn; pip install triton if torch did not bring it).
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
part() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)" | tee -a "$OUT/summary.txt"
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  echo "-- $name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}
part kernel_tests 80 "$PY" -m pytest tests/gpu/test_fused_logprobs_gpu.py -q -s -p no:cacheprovider
part kernel_bench 100 "$PY" benchmarks/logprob_kernel.py --device cuda --dtype bfloat16 \
  --sizes 8192x150000x4096 16384x152064x2048 --max-naive-gb 60
# ~1.4B parameters: Llama-3 attention layout (32 heads, 8 KV groups, 128k vocabulary), 2048 hidden, 16 layers.
part train_step 140 "$PY" benchmarks/train_step.py --model llama3_8b --device cuda --samples 16 --length 2048 \
  --micro-batch-tokens 8192 --steps 5 --hidden 2048 --layers 16 --peak-tflops 989
part colocation 150 "$PY" -m pytest tests/gpu/test_colocation_gpu.py -q -s -p no:cacheprovider
# Packed rows on the Transformer Engine spec (THD attention keeps samples apart); LoRA with its fused norms.
part packed_attention 120 "$PY" -m pytest tests/gpu/test_packed_attention_gpu.py tests/gpu/test_lora_gpu.py -q -s \
  -p no:cacheprovider
echo "results in $OUT/summary.txt"
