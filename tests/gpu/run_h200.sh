#!/usr/bin/env bash
# One prepared run of every GPU measurement, sized to finish within ~8 minutes on one H100/H200: kernel
# correctness, memory and time of the fused log-probs; training-step tokens/s and MFU of a ~1.3B model on
# Megatron's local spec and, where Transformer Engine imports, on the TE spec; weight sync against a plain
# device copy of the same bytes; the transformers engine's tokens/s against plain `generate` on the same
# weights, batch and dtype; offload/onload and real memory release; packed rows on the TE spec; context
# parallelism's memory (the CPU path, in the dry run; on GPUs it needs 2 and TE: said as not measured). Each part has its own timeout so one slow part cannot
# eat the others' time. Results: $OUT/summary.txt (each part's last lines) and $OUT/results.json (each part's
# exit code, seconds, the `RESULT {...}` lines its benchmark printed, and its last lines); $OUT defaults to
# ./gpu-results.
#
#   bash tests/gpu/run_h200.sh          # on the GPU machine, from the repository root
#   DRY=1 bash tests/gpu/run_h200.sh    # every part at toy sizes on the CPU (the suite runs this)
#
# Needs the GPU environment: `bash launch/setup_env.sh --gpu` (the pinned CUDA torch, triton, TE, flash-attn,
# SGLang; docs/install.md). On a machine without a network whose
# python already has torch, triton and transformers: WHEELS=<folder of the other wheels (megatron-core,
# hydra-core, omegaconf, antlr4-python3-runtime)> PYTHON=python3 installs those into /tmp/site and maps the
# checkout's packages there. Without Transformer Engine the model parts run Megatron's local spec
# (model.transformer_impl=local; the TE-only tests skip) and every figure says which spec it came from.
# PARTS="kernel_bench train_step_local" runs only the parts named. The wheels for a Python 3.12 machine, made where pip
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
rm -f "$OUT/summary.txt" "$OUT/parts.tsv"
if [[ "${DRY:-0}" == 1 ]]; then
  DEV=cpu DTYPE=float32 GPUS=0
  echo "dry run on the CPU: toy sizes, GPU-only tests skip" > "$OUT/gpu.txt"
else
  DEV=cuda DTYPE=bfloat16
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
fi
"$PY" - >> "$OUT/gpu.txt" 2>&1 <<'PY'
import torch, transformers, megatron.core
from megatron_rl.models.gpt import te_available
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "missing"
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, transformers {transformers.__version__}, "
      f"megatron-core {megatron.core.__version__}, Transformer Engine {'yes' if te_available() else 'no'}, {device}")
PY
cat "$OUT/gpu.txt"
TE=0
"$PY" -c "from megatron_rl.models.gpt import te_available; raise SystemExit(0 if te_available() else 1)" && TE=1
part() {  # name, timeout seconds, command...; PARTS="name ..." runs only those
  local name=$1 limit=$2; shift 2
  [[ -z "${PARTS:-}" || " $PARTS " == *" $name "* ]] || return 0
  echo "== $name (limit ${limit}s)" | tee -a "$OUT/summary.txt"
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "Warning\|warnings.warn" "$OUT/$name.log" | tail -n 14 | tee -a "$OUT/summary.txt"
  echo "-- $name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/parts.tsv"
}
skip() {  # name, why: a part this machine cannot run, said in both outputs
  [[ -z "${PARTS:-}" || " $PARTS " == *" $1 "* ]] || return 0
  echo "== $1: not measured ($2)" | tee -a "$OUT/summary.txt"
  echo "not measured: $2" > "$OUT/$1.log"
  printf '%s\t%s\t%s\n' "$1" "skipped" 0 >> "$OUT/parts.tsv"
}
PYTEST=("$PY" -m pytest -q -s -p no:cacheprovider -p no:warnings)
if [[ "${DRY:-0}" == 1 ]]; then  # toy sizes: every command line below runs, in seconds
  KERNEL_SIZES=(256x4096x64) TRAIN=(--model tiny_qwen2 --samples 4 --length 64 --micro-batch-tokens 256 --steps 2)
  SYNC=(--model tiny_qwen2 --repeats 2) ROLLOUT=(model=tiny_qwen2 global_batch_size=8 rollout.max_new_tokens=8)
  CP=(--model tiny_qwen2 --length 256 --steps 1 --repeats 1)
else
  # ~1.3B parameters: Llama-3 attention layout (32 heads, 8 KV groups, 128k vocabulary), 2048 hidden, 16 layers.
  KERNEL_SIZES=(8192x150000x4096 16384x152064x2048)
  # --no-transformers: that arm's padded fp32 log-softmax over 128k columns at 16 x 2048 tokens alone needs
  # ~34 GB and would take the part's time; the dry run above keeps it, so its code runs in CI
  TRAIN=(--model llama3_8b --samples 16 --length 2048 --micro-batch-tokens 8192 --steps 5 --hidden 2048
         --layers 16 --peak-tflops 989 --no-transformers)
  SYNC=(--model qwen2_5_0_5b --repeats 5)
  ROLLOUT=(model=qwen2_5_0_5b global_batch_size=64 rollout.max_new_tokens=256 micro_batch_tokens=16384)
fi
part kernel_tests 90 "${PYTEST[@]}" tests/gpu/test_fused_logprobs_gpu.py tests/gpu/test_topk_logprobs_gpu.py
part kernel_bench 110 "$PY" benchmarks/logprob_kernel.py --device $DEV --dtype $DTYPE --threads 16 \
  --sizes "${KERNEL_SIZES[@]}" --max-naive-gb 60
part train_step_local 120 "$PY" benchmarks/train_step.py "${TRAIN[@]}" --device $DEV --transformer-impl local
if [[ $TE == 1 ]]; then
  part train_step_te 120 "$PY" benchmarks/train_step.py "${TRAIN[@]}" --device $DEV --transformer-impl transformer_engine
else
  skip train_step_te "Transformer Engine does not import here"
fi
part weight_sync 60 "$PY" benchmarks/weight_sync.py "${SYNC[@]}" --device $DEV --dtype $DTYPE --transformer-impl local
part rollout 120 "$PY" benchmarks/rollout.py --steps 2 --repeats 2 "${ROLLOUT[@]}" cluster.device=$DEV \
  rollout.backend=hf task=arithmetic rollout.n_samples_per_prompt=8 model.dtype=$DTYPE
if [[ "${DRY:-0}" == 1 ]]; then  # benchmarks/context_parallel.py measures the CPU path (gloo ranks)
  part context_parallel 120 "$PY" benchmarks/context_parallel.py "${CP[@]}" --cp 2
else
  skip context_parallel "the CP benchmark measures the CPU path; on GPUs CP is TE's ring attention, which needs 2 GPUs and TE (this machine: $GPUS GPU(s), TE $TE)"
fi
part colocation 80 "${PYTEST[@]}" tests/gpu/test_colocation_gpu.py
# Packed rows on the Transformer Engine spec (THD attention keeps samples apart); LoRA with its fused norms.
part packed_attention 60 "${PYTEST[@]}" tests/gpu/test_packed_attention_gpu.py tests/gpu/test_lora_gpu.py
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
results = {"machine": (out / "gpu.txt").read_text().strip(), "parts": {}}
for line in (out / "parts.tsv").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    log = (out / f"{name}.log").read_text(errors="replace").splitlines()
    found = [json.loads(l.split("RESULT ", 1)[1]) for l in log if l.startswith("RESULT ")]
    # pytest's 5: every test skipped (no CUDA GPU here, the dry run)
    skipped = rc == "skipped" or (rc == "5" and any(" skipped" in l for l in log[-3:]))
    results["parts"][name] = {"rc": None if rc == "skipped" else int(rc), "seconds": int(seconds),
                              "skipped": skipped, "results": found, "tail": log[-14:]}
(out / "results.json").write_text(json.dumps(results, indent=1))
PY
echo "results in $OUT/summary.txt and $OUT/results.json"
