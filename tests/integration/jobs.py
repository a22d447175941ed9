"""Running the main job as a subprocess in tests: its environment, its metrics, killing it
(SIGKILL, the whole process group) once it has logged a given number of steps, and reading
which signals a process is shielded from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def job_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def shielded_signals(pid: int) -> set[int]:
    """The signals a process blocks (its main thread) or ignores (/proc/<pid>/status: SigBlk and SigIgn, bit
    masks from signal 1)."""
    mask = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("SigBlk", "SigIgn"):
            mask |= int(value.split()[0], 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows written so far: complete lines only (a running job may be half-way through one)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def run_until_killed(args: list[str], run_dir: Path, lines: int, timeout_s: float = 600) -> None:
    """Start the job, SIGKILL it (every process of it, without warning) after `lines` metric rows."""
    proc = subprocess.Popen(args, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while len(read_metrics(run_dir)) < lines:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def warm_started(out: Path, run_args: list[str], timeout_s: float = 600) -> Path:
    """The model after a run's supervised warm start, as an HF checkpoint that later runs of a test file start
    from (`model.path=<it>`, `task.sft_warmup_steps=0`) instead of each repeating the same warm start.
    `run_args`: the `megatron_rl.train` command line whose task, model and task.sft_warmup_steps define the
    warm start. It runs once, with one RL step (num_steps >= 1) after the warm start and no evaluation."""
    run_dir = out / "warm"
    proc = subprocess.run([*run_args, f"run_dir={run_dir}", "num_steps=1", "task.num_eval=0",
                           "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=true"],
                          env=job_env(), capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warm start: " in proc.stderr, "the run had no warm start to share"
    (path,) = (run_dir / "hf").iterdir()
    return path
