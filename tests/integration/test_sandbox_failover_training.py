"""Training survives losing a sandbox server: two real servers register under the run directory,
the RL job discovers both, one is SIGKILLed after the first steps, and the job finishes every
step with rewards from the other (no verifier errors, calls still made)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.slurm_job import sandbox_health
from tests.integration.jobs import read_metrics
from tests.integration.sandbox_servers import runtime_args, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def test_training_continues_when_one_of_two_sandbox_servers_dies(tmp_path):
    if runtime_args("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    run_dir = tmp_path / "run"
    doomed, survivor = (start_server("bwrap", "--capacity", "1", run_dir=run_dir) for _ in range(2))
    try:
        args = [sys.executable, "-m", "megatron_rl.train", "mode=rl", f"run_dir={run_dir}", f"num_steps={STEPS}",
                "cluster.device=cpu", "global_batch_size=32", "rollout.n_samples_per_prompt=8",
                "rollout.max_new_tokens=16", "task.num_train=256", "task.num_eval=8", "task.eval_every=0",
                "task.eval_samples=1", "task.sft_warmup_steps=30", "logging.progress=false"]
        proc = subprocess.Popen(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while len(read_metrics(run_dir)) < 3:  # step 0's evaluation and two steps
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        doomed.kill()  # SIGKILL: no drain, its discovery file stays behind
        served_before = sandbox_health(survivor.address).executions_finished
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        rows = read_metrics(run_dir)
        assert [r["step"] for r in rows] == list(range(STEPS + 1))  # 0: the evaluation before any update
        rows = rows[1:]
        assert all(r["reward/verifier_errors"] == 0 for r in rows)
        assert all(r["reward/verifier_calls"] > 0 for r in rows[2:])
        assert sandbox_health(survivor.address).executions_finished > served_before, "the survivor took over"
        assert "local sandbox server" not in stderr, "the job used the registered servers"
    finally:
        doomed.kill()
        survivor.stop()
