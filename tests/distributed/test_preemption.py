"""Graceful stop with the local launcher: SIGUSR1 to the launcher reaches both ranks, which agree
on the step to stop after (one all-reduce), checkpoint it, record `preempted.json` and exit 0;
the same command then resumes there and runs every remaining step exactly once. A stop during the
supervised warm start checkpoints the warm start's progress, and the rerun continues it: the run's
metrics are those of a run that was never stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.jobs import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 12


def _args(run_dir: Path, steps: int = STEPS, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.train", "mode=rl", "task=arithmetic", f"run_dir={run_dir}",
            f"num_steps={steps}", *extra, "cluster.nproc=2", "cluster.device=cpu", "global_batch_size=16",
            "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=16", "task.num_train=64", "task.num_eval=4",
            "task.eval_every=0", "task.eval_samples=1", "checkpoint.save_every=100", "logging.progress=false"]


def _steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir)]


def test_usr1_stops_both_ranks_after_the_same_step_and_the_rerun_resumes(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(_args(run_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(_steps(run_dir)) < 3:  # step 0's evaluation and two steps
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # to the launcher only, as a batch system would
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    stopped = marker["steps_done"]
    assert marker["signal"] == "SIGUSR1" and 2 <= stopped < STEPS
    # Both ranks stop after the same step. How many of them had the signal by the agreeing
    # all-reduce is timing (the launcher forwards it to one rank, then the other), so 1 or 2.
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert re.search(rf"stop requested \(SIGUSR1 on [12] rank\(s\)\): stopping after step {stopped} of", log), rank
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert _steps(run_dir) == list(range(stopped + 1))

    rerun = subprocess.run(_args(run_dir), env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step_{stopped:08d}" in rerun.stderr
    assert _steps(run_dir) == list(range(STEPS + 1))
    assert not (run_dir / "preempted.json").exists()


def _timing(key: str) -> bool:
    return key.startswith(("time/", "sync/")) or key.endswith("per_s")


def test_a_stop_during_the_warm_start_checkpoints_it_and_the_rerun_continues_it(tmp_path):
    warm = ("task.sft_warmup_steps=60",)  # ~65 ms per step here
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    straight = tmp_path / "straight"
    done = subprocess.run(_args(straight, 2, *warm), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_args(run_dir, 2, *warm), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    log = run_dir / "logs" / "rank0.log"
    deadline = time.monotonic() + 300
    while "warm start 1/60" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, "no warm-start step"
        time.sleep(0.02)
    for _ in range(2):  # as Slurm at the time limit
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    marker = json.loads((run_dir / "preempted.json").read_text())
    stopped = marker["warm_start_steps"]
    assert marker["signal"] == "SIGTERM" and marker["steps_done"] == 0 and 1 <= stopped < 60, marker
    for rank in (0, 1):
        assert f"stopping after warm-start step {stopped} of 60" in (run_dir / "logs" / f"rank{rank}.log").read_text()
    meta = json.loads((run_dir / "checkpoints" / "step_00000000" / "meta.json").read_text())
    assert meta["warm_start"] == stopped and not meta["critic"]
    assert not _steps(run_dir)  # no RL step ran

    rerun = subprocess.run(_args(run_dir, 2, *warm), env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"warm start: continuing after step {stopped} of 60" in rerun.stderr
    assert f"warm start: {60 - stopped} supervised steps" in rerun.stderr
    # the same warm start (same batches, optimizer state and schedule), then the same RL steps
    last_warm = [line.split("] ", 1)[1] for line in (done.stderr + rerun.stderr).splitlines()
                 if "warm start 60/60" in line]
    assert len(last_warm) == 2 and last_warm[0] == last_warm[1], last_warm
    got, want = read_metrics(run_dir), read_metrics(straight)
    assert [m["step"] for m in got] == [0, 1, 2]
    for row, ref in zip(got, want, strict=True):
        assert {k: v for k, v in row.items() if not _timing(k)} == {k: v for k, v in ref.items() if not _timing(k)}
    assert not (run_dir / "preempted.json").exists()
