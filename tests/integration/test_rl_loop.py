"""A few RL steps end to end on CPU, as a user runs them: warm start, colocated rollouts with
the hf engine, rewards executed by a real sandbox server started by the job, GRPO updates,
evaluation, checkpoints, metrics and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.sandbox_servers import runtime_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    run_dir = tmp_path_factory.mktemp("rl") / "run"
    args = [sys.executable, "-m", "megatron_rl.train", "+experiment=demo_countdown", f"run_dir={run_dir}",
            "num_steps=3", "global_batch_size=64", "rollout.n_samples_per_prompt=8", "task.sft_warmup_steps=30",
            "task.num_eval=16", "task.eval_every=2", "task.eval_samples=2", "checkpoint.save_every=2",
            "logging.progress=false"]
    proc = subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows, proc.stderr


def test_every_step_has_rl_metrics(run):
    _, rows, _ = run
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # 0: the evaluation before any update
    trained = rows[1:]
    for key in ("reward/mean", "kl/policy_old_new", "entropy", "clip_frac", "response_length/mean", "tokens_per_s",
                "time/generate", "time/sync_weights", "time/train", "sync/gb_per_s", "grad_norm"):
        assert all(key in r for r in trained), key
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in trained)
    assert [r["weight_version"] for r in trained] == [2, 3, 5]  # eval rollouts sync too (after steps 2 and 3)


def test_the_first_update_has_importance_ratio_one(run):
    _, rows, _ = run
    for r in rows[1:]:
        assert r["rollout/logprob_mismatch"] <= 1e-4
        assert abs(r["kl/policy_old_new_first_update"]) <= 1e-6


def test_rewards_came_from_the_sandbox_server(run):
    run_dir, rows, stderr = run
    assert rows[-1]["reward/verifier_calls"] > 0 and rows[-1]["reward/verifier_errors"] == 0
    assert "local sandbox server (bwrap)" in stderr
    assert not list((run_dir / "sandbox").glob("*.json")), "the job stops its sandbox server at the end"


def test_evaluation_checkpoints_and_plots(run):
    run_dir, rows, stderr = run
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 3] and "eval/pass@k" in rows[3]
    assert "at step 0 (after a 30-step warm start) -> " in stderr
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert (run_dir / "plots" / "reward_mean.png").exists()


def test_kl_loss_against_the_reference_policy(tmp_path):
    """kl_coef > 0: reference log-probs come from the policy RL started from (swapped in from
    host memory); at the first step the policy is the reference, so the KL is exactly 0.
    (The swap itself is checked in tests/distributed/test_trainer.py.)"""
    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed")
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "megatron_rl.train", "+experiment=demo_countdown", f"run_dir={run_dir}",
            "num_steps=3", "global_batch_size=32", "rollout.n_samples_per_prompt=8", "task.sft_warmup_steps=10",
            "task.num_eval=8", "task.eval_every=0", "task.eval_samples=1", "algorithm.kl_coef=0.1",
            "optimizer.lr=1e-3", "logging.progress=false"]
    proc = subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all("kl/ref" in r for r in rows[1:])
    assert rows[1]["kl/ref"] == 0.0
