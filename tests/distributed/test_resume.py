"""Exact resume: the main job killed with SIGKILL, or stopped by Slurm's SIGTERM, in the middle of
a run and started again with the same command produces the same per-step metrics as a run that
was never interrupted (deterministic CPU mode), and a metrics file without duplicates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.jobs import read_metrics, run_until_killed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def _args(run_dir: Path, extra=(), save_every: int = 2):
    return [sys.executable, "-m", "megatron_rl.train", "mode=sft", f"num_steps={STEPS}", f"run_dir={run_dir}",
            f"checkpoint.save_every={save_every}", "logging.progress=false", "global_batch_size=32", *extra]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _kill_after(run_dir: Path, min_lines: int, extra=()) -> None:
    run_until_killed(_args(run_dir, extra), run_dir, min_lines, timeout_s=300)


def _compare(resumed: list[dict], reference: list[dict]) -> None:
    assert [m["step"] for m in resumed] == list(range(STEPS + 1))  # 0: the held-out loss before any update
    assert resumed[0] == reference[0]
    for got, want in zip(resumed[1:], reference[1:], strict=True):
        for key in ("loss", "grad_norm", "lr", "num_tokens"):
            assert got[key] == want[key], (got["step"], key, got[key], want[key])
    assert resumed[-1]["eval_loss"] == reference[-1]["eval_loss"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    subprocess.run(_args(run_dir), env=_env(), check=True, capture_output=True)
    return read_metrics(run_dir)


def test_killed_run_resumes_with_identical_metrics(tmp_path, reference):
    run_dir = tmp_path / "run"
    _kill_after(run_dir, min_lines=4)  # row 0 and steps 1-3: checkpoint 2 is written
    killed_at = len(read_metrics(run_dir))
    assert killed_at <= STEPS  # of rows 0..STEPS
    proc = subprocess.run(_args(run_dir), env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    _compare(read_metrics(run_dir), reference)


def test_killed_two_rank_run_resumes_with_identical_metrics(tmp_path):
    extra = ("cluster.nproc=2", "parallel.tp=2")
    straight = tmp_path / "straight"
    subprocess.run(_args(straight, extra), env=_env(), check=True, capture_output=True)
    run_dir = tmp_path / "run"
    _kill_after(run_dir, min_lines=4, extra=extra)
    proc = subprocess.run(_args(run_dir, extra), env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _compare(read_metrics(run_dir), read_metrics(straight))


def test_a_run_stopped_by_sigterm_checkpoints_and_resumes_with_identical_metrics(tmp_path, reference):
    """SFT watches for the stop signals as RL does: SIGTERM, twice as Slurm sends it at the time limit,
    ends the run after the current step with a checkpoint of that step (no periodic one is due) and
    `preempted.json`; the same command resumes there."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_args(run_dir, save_every=100), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(run_dir):  # row 0 (before any update): all six steps remain (~0.1 s each here)
            assert proc.poll() is None and time.monotonic() < deadline, "no step"
            time.sleep(0.02)
        for _ in range(2):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    stopped = marker["steps_done"]
    assert marker["signal"] == "SIGTERM" and 1 <= stopped < STEPS, marker
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(stopped + 1))
    rerun = subprocess.run(_args(run_dir, save_every=100), env=_env(), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from" in rerun.stderr
    _compare(read_metrics(run_dir), reference)
