"""The fast tier's end-to-end check (`bash launch/test.sh --fast`): the main job runs one small RL step
on CPU as a user starts it, with a rule-checked task (no sandbox server), and then resumes from its
checkpoint for a second step. It reads what the run wrote, not its log: every phase ran (evaluation,
rollout with a weight sync, update, checkpoint, plots) and the resumed job carried on from the
checkpoint (the sampler's position, the weight version)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
SMALL = ["task=arithmetic", "global_batch_size=8", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8",
         "task.num_eval=4", "task.eval_samples=1", "task.sft_warmup_steps=0", "checkpoint.save_every=1",
         "logging.progress=false"]


def _train(run_dir: Path, *extra: str) -> list[dict]:
    args = [sys.executable, "-m", "megatron_rl.train", *SMALL, f"run_dir={run_dir}", *extra]
    proc = subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_one_rl_step_end_to_end_then_a_resumed_one(tmp_path):
    run_dir = tmp_path / "run"
    rows = _train(run_dir, "num_steps=1")
    assert [r["step"] for r in rows] == [0, 1]  # 0: the evaluation before any update
    step = rows[1]
    for key in ("reward/mean", "eval/accuracy", "time/sync_weights", "time/generate", "time/train", "grad_norm",
                "kl/policy_old_new", "filter/kept_samples"):
        assert key in step, key
    assert step["weight_version"] == 2  # the step-0 evaluation synced v1, the step's rollout v2
    assert step["filter/kept_samples"] == 8  # every sample of the 2 groups of 4 trained
    assert (run_dir / "checkpoints" / "step_00000001" / "meta.json").is_file()
    assert list((run_dir / "plots").glob("*.png"))
    rows = _train(run_dir, "num_steps=2")  # the same run directory: resumes after step 1
    assert [r["step"] for r in rows] == [0, 1, 2]
    # resumed at weight version 3 (after step 1's final evaluation): step 2 generates with v4
    assert rows[2]["weight_version"] == 4
