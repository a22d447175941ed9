"""Running the main job as a subprocess in tests: its environment, its metrics, and killing
it (SIGKILL, the whole process group) once it has logged a given number of steps."""

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


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


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
