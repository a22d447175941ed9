"""tests/gpu/run_h200.sh, the prepared GPU check, in its dry mode: every part's command line runs at toy sizes
on the CPU (the GPU-only tests skip), and the script writes its summary and one JSON file that names every
part with its exit code, its benchmark's RESULT lines, and why a part was not measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
PARTS = {"kernel_tests", "kernel_bench", "train_step_local", "train_step_te", "weight_sync", "rollout",
         "context_parallel", "colocation", "packed_attention"}
MEASURED = {"kernel_bench": "fused_mb", "train_step_local": "tokens_per_s", "rollout": "engine_vs_generate",
            "weight_sync": "ratio", "context_parallel": "memory_ratio"}


def test_the_dry_run_runs_every_part_and_writes_one_json(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "tests/gpu/run_h200.sh"], cwd=REPO, capture_output=True, text=True, timeout=580,
                          env=dict(os.environ, DRY="1", OUT=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["parts"]) == PARTS
    assert "dry run on the CPU" in results["machine"]
    for name, part in results["parts"].items():
        assert part["skipped"] or part["rc"] == 0, (name, part["tail"])
    # the GPU-only tests skip on the CPU; TE is not installed here: said, not left out
    assert all(results["parts"][n]["skipped"] for n in ("kernel_tests", "colocation", "packed_attention"))
    assert results["parts"]["train_step_te"]["skipped"]
    assert "Transformer Engine does not import here" in (out / "train_step_te.log").read_text()
    for name, key in MEASURED.items():
        found = results["parts"][name]["results"]
        assert found and all(key in r for r in found), (name, found)
    summary = (out / "summary.txt").read_text()
    assert all(f"== {name}" in summary for name in PARTS)
