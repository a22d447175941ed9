"""A black-box agent trains: `python -m megatron_rl.train` with task.agent_command running
docs/examples/openai_countdown_agent.py (a plain multi-turn script against the real `openai` client, with a
tool) per episode against the job's OpenAI-compatible endpoint, on the tiny model, for 2 GRPO steps on CPU
(conf/experiment/demo_openai_agent.yaml, shortened).

What it shows: every step trains on the episodes whose recorded tokens form one sequence, and leaves out and
counts those that do not (the random model writes `<|im_start|>` or ends a reply with eos, which the text the
agent sends back cannot reproduce); the trainer's log-probs of the assembled episodes equal the engine's recorded
ones (rollout/logprob_mismatch ~1e-6: a misplaced token or loss mask would show as a large difference); the
agent's reward and its extra number reach the metrics; a config error in the agent command fails before any
work starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the example agent uses the openai client: pip install -e '.[dev]'")

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *overrides: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    """The shipped recipe (conf/experiment/demo_openai_agent.yaml), shortened to 2 steps of 16 episodes; the agent
    runs on this interpreter (it has the openai client), the trainer on `python`."""
    args = [python, "-m", "megatron_rl.train", "+experiment=demo_openai_agent",
            f"task.agent_command=[{sys.executable},{REPO / 'docs/examples/openai_countdown_agent.py'}]",
            "task.num_train=16", "num_steps=2", "global_batch_size=16", "logging.progress=false",
            f"run_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=500)


@pytest.mark.parametrize("nproc", [1, 2], ids=["one_rank", "dp2"])
def test_a_black_box_openai_agent_trains_on_its_recorded_tokens(tmp_path, nproc):
    """At DP=2 each rank plays its share of the episodes through an endpoint of its own, on its own engine."""
    proc = _run(tmp_path, f"cluster.nproc={nproc}")
    _check_trained(tmp_path, proc)
    assert "does not extend the tokens the engine saw" in proc.stderr  # each mismatch is logged


def _check_trained(tmp_path: Path, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        trained, mismatched = r["agent/submitted"], r["agent/mismatch"]
        assert trained + mismatched + r["agent/agent_failed"] + r["agent/sampling_mismatch"] == 16
        assert trained > 0 and r["filter/kept_samples"] == trained  # only the episodes that form one sequence
        assert r["filter/dropped_episodes"] == 16 - trained
        assert r["agent/agent_failed"] == 0 and r["agent/sampling_mismatch"] == 0
        assert r["rollout/logprob_mismatch"] < 1e-4  # the trainer's log-probs of the episodes = the engine's
        assert r["grad_norm"] > 0 and 1.0 < r["agent/turns_mean"] <= 3  # an update happened; multi-turn episodes
        assert "agent/env/solved" in r  # the agent's extra number
    assert "OpenAI-compatible endpoint for the agent program: http://127.0.0.1:" in proc.stderr


def test_the_endpoint_serves_from_a_real_sglang_engine(tmp_path):
    """rollout=sglang (a real SGLang engine on CPU, in the SGLang venv of tests/integration/sglang/setup.sh): the
    same endpoint in front of it, the same checks, the trainer's log-probs equal SGLang's within the SGLang
    parity tolerance."""
    from tests.integration.sglang import harness

    python = harness.venv_python()
    if python is None or not (harness.venv() / ".megatron-rl-project-deps").exists():
        pytest.skip(f"no complete SGLang venv at {harness.venv()}: run `bash tests/integration/sglang/setup.sh`")
    proc = _run(tmp_path, "rollout=sglang", "rollout.max_total_tokens=4096", "logging.tensorboard=false",
                python=str(python))
    _check_trained(tmp_path, proc)
    assert "starting SGLang engine" in proc.stderr


def test_an_agent_command_that_does_not_exist_fails_before_any_work(tmp_path):
    proc = _run(tmp_path, "task.agent_command=[/nonexistent/agent]")
    assert proc.returncode != 0
    assert "task.agent_command=['/nonexistent/agent']: '/nonexistent/agent' is neither on PATH nor a file" \
        in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
