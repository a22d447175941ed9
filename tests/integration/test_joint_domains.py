"""Multi-domain joint RL end to end on CPU: two rule-verified domains whose rewards come on
different scales (domain `a`: pass/fail 0 or 1; domain `b`: the same kind of task with
task.reward_scale=10, so 0 or 10), mixed 1:1, Dr. GRPO advantages (r - group mean: they keep
the reward scale, unlike GRPO's division by the group std).

- Without calibration the scale leaks into the advantages: b's advantage std is ~10x a's.
- With algorithm.domain_calibration=running both domains' advantage statistics are alike, and
  at the first step (where both runs drew the same samples, and a domain's running statistics
  are that step's own) each domain's advantages are exactly the uncalibrated ones divided by
  the domain's reward std, which for 0/s rewards with success rate p is s * sqrt(p (1 - p)).
- A joint run killed mid-way and started again logs the same per-step and per-domain metrics
  as one never interrupted (sampler quotas, calibration statistics and the monitor's history
  travel in the checkpoint).

Each domain is a JSONL set whose answer (1 or 2) cannot be read from the prompt, so that after
the warm start taught the answer format the success rate sits near 1/2 and nearly every
group carries a signal. The warm start runs once (`jobs.warm_started`); every run starts from it.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tests.integration.jobs import run_until_killed, warm_started

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
SCALE = 10.0
STEPS = 4


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("domains")
    for name, seed in (("a", 0), ("b", 1)):
        rng = random.Random(seed)
        rows = []
        for i in range(200):
            answer = rng.choice([1, 2])
            rows.append({"prompt": f"{name.upper()}{i}:", "answer": answer, "response": f"\\boxed{{{answer}}}"})
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _joint(data: Path) -> list[str]:
    domains = (f"+domains={{a:{{task:{{name:a,type:dataset,path:{data / 'a.jsonl'},num_eval:4}}}},"
               f"b:{{task:{{name:b,type:dataset,path:{data / 'b.jsonl'},num_eval:4,reward_scale:{SCALE}}}}}}}")
    return [sys.executable, "-m", "megatron_rl.train", "mode=rl", "model=tiny_qwen2", "global_batch_size=64",
            "rollout.n_samples_per_prompt=8", "rollout.max_new_tokens=10", "micro_batch_tokens=1024",  # \\boxed{2}
            "optimizer.lr=2e-4", "task.eval_samples=2", "logging.progress=false", "logging.tensorboard=false",
            "algorithm.advantage_estimator=dr_grpo", domains]


@pytest.fixture(scope="module")
def start(tmp_path_factory, data) -> list[str]:
    """What every run below shares: the domains, and the model after the answer format was taught once (a
    joint warm start of 60 steps), which each run starts from instead of repeating the warm start."""
    warm = warm_started(tmp_path_factory.mktemp("warm"), [*_joint(data), "task.sft_warmup_steps=60"])
    return [*_joint(data), f"model.path={warm}", "task.sft_warmup_steps=0"]


def _args(run_dir: Path, start: list[str], calibration: str, *extra: str) -> list[str]:
    return [*start, f"run_dir={run_dir}", f"num_steps={STEPS}", f"algorithm.domain_calibration={calibration}", *extra]


def _run(args: list[str], run_dir: Path) -> list[dict]:
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _metrics(run_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, start) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("joint")
    runs = {cal: _run(_args(root / cal, start, cal, "task.eval_every=0", "checkpoint.save_at_end=false"), root / cal)
            for cal in ("none", "running")}
    assert all(rows[0]["step"] == 0 and "reward/mean" not in rows[0] for rows in runs.values())  # before updates
    return {cal: rows[1:] for cal, rows in runs.items()}


def _ratio(row: dict) -> float:
    return row["domain/b/adv_std"] / row["domain/a/adv_std"]


def test_every_step_logs_both_domains(runs):
    for rows in runs.values():
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        for r in rows:
            assert r["domain/a/count"] == r["domain/b/count"] == 32  # 1:1 mixture of 8 groups of 8
            assert r["domain/a/share"] == r["domain/b/share"] == 0.5 and r["domain/a/paused"] == 0
            assert r["domain/a/reward_mean"] in [k / 32 for k in range(33)]  # 0/1 rewards
            assert r["domain/b/reward_mean"] in [SCALE * k / 32 for k in range(33)]  # 0/10 rewards
            assert abs(r["domain/a/adv_mean"]) < 1e-6 and abs(r["domain/b/adv_mean"]) < 1e-6  # group-centred
            assert r["domain/a/adv_std"] > 0 and r["domain/b/adv_std"] > 0
        final = rows[-1]  # held-out accuracy per domain, b's divided back by its scale
        assert 0 <= final["eval/a/accuracy"] <= 1 and 0 <= final["eval/b/accuracy"] <= 1
        assert final["eval/accuracy"] == pytest.approx((final["eval/a/accuracy"] + final["eval/b/accuracy"]) / 2)


def test_without_calibration_the_larger_scale_dominates_the_advantages(runs):
    # Dr. GRPO: A = r - mean_g, so b's advantages are 10x those of a with the same outcomes; the
    # outcomes' own spread differs between the domains by a factor well inside 3.
    for r in runs["none"]:
        assert SCALE / 3 < _ratio(r) < SCALE * 3, (r["step"], _ratio(r))
    assert "domain/a/calib_std" not in runs["none"][0]


def test_running_calibration_keeps_the_domains_advantages_comparable(runs):
    for r in runs["running"]:
        assert 1 / 3 < _ratio(r) < 3, (r["step"], _ratio(r))
        for d in "ab":  # z-scored rewards, centred within groups: std at most ~1
            assert 0.3 < r[f"domain/{d}/adv_std"] < 1.5


def test_first_step_advantages_are_the_raw_ones_over_each_domains_reward_std(runs):
    none, running = runs["none"][0], runs["running"][0]
    for d, scale in (("a", 1.0), ("b", SCALE)):
        mean = none[f"domain/{d}/reward_mean"]
        assert running[f"domain/{d}/reward_mean"] == mean  # step 1 drew the same samples in both runs
        p = mean / scale
        std = scale * math.sqrt(p * (1 - p))  # population std of rewards in {0, scale}, success rate p
        assert running[f"domain/{d}/calib_std"] == pytest.approx(std, rel=1e-9)
        assert running[f"domain/{d}/adv_std"] == pytest.approx(none[f"domain/{d}/adv_std"] / std, rel=1e-5)


def test_a_joint_run_resumes_exactly_after_sigkill(tmp_path, start):
    common = ["checkpoint.save_every=1", "task.eval_every=1", "algorithm.domain_pause_window=2"]
    reference = _run(_args(tmp_path / "reference", start, "running", *common), tmp_path / "reference")
    args = _args(tmp_path / "resumed", start, "running", *common)
    run_until_killed(args, tmp_path / "resumed", lines=3)  # step 0's evaluation and two steps
    resumed = _run(args, tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(STEPS + 1))
    for want, got in zip(reference, resumed, strict=True):
        keys = [k for k in want if k.startswith(("domain/", "eval/", "reward/mean", "loss", "grad_norm"))]
        assert keys and {k: got[k] for k in keys} == {k: want[k] for k in keys}, want["step"]
