"""The RL loop with the options the demo does not use, end to end on CPU:

- prompts from a saved Hugging Face dataset (train/test splits) rendered with the chat
  template, rule rewards, DAPO dynamic sampling and the zero-variance / overlong filters;
- exact resume of the RL loop: a run SIGKILLed mid-way and started again with the same
  command logs the same per-step metrics as a run that was never interrupted;
- the `tests` verifier: a dataset row's tests run in a real sandbox server (passed / total).

The runs on the saved dataset start from one shared warm start (`jobs.warm_started`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.jobs import run_until_killed, warm_started
from tests.integration.sandbox_servers import runtime_args, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 5


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _addition_rows(num: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"question": f"{a}+{b}=", "answer": a + b, "response": f"\\boxed{{{a + b}}}"})
    return rows


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory):
    import datasets

    path = tmp_path_factory.mktemp("data") / "addition"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_addition_rows(400, 0)),
                          "test": datasets.Dataset.from_list(_addition_rows(40, 1))}).save_to_disk(str(path))
    return path


def _task(dataset: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.train", "+experiment=demo_countdown", "task=arithmetic",
            "task.type=dataset", f"task.path={dataset}", "task.prompt_key=question", "task.chat_template=true",
            "global_batch_size=32", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=10",
            # the tiny model, briefly warm-started, seldom writes a whole `\\boxed{}` sum: its answers are
            # read by their last number too (task.answer_extraction=last_number) so that rewards vary,
            # which the mechanics tested here need
            "task.answer_extraction=last_number", "logging.progress=false"]


@pytest.fixture(scope="module")
def start(tmp_path_factory, saved_dataset) -> list[str]:
    """What every run below shares: the task, and the model after the chat format was taught once (20
    supervised steps), which each run starts from instead of repeating the warm start."""
    warm = warm_started(tmp_path_factory.mktemp("warm"), [*_task(saved_dataset), "task.sft_warmup_steps=20"])
    return [*_task(saved_dataset), f"model.path={warm}", "task.sft_warmup_steps=0"]


def _args(run_dir: Path, start: list[str], *extra: str) -> list[str]:
    return [*start, "task.num_eval=8", "task.eval_samples=2", f"run_dir={run_dir}", *extra]


def test_dataset_chat_template_dynamic_sampling_and_filters(tmp_path, start):
    run_dir = tmp_path / "run"
    args = _args(run_dir, start, "num_steps=3", "task.eval_every=0", "algorithm.dynamic_sampling=true",
                 "algorithm.dynamic_sampling_max_rounds=3", "algorithm.filter_zero_variance=true",
                 "algorithm.overlong=filter")
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # 0: the evaluation before any update
    rows, evaluated = rows[1:], rows
    target = 32 // 4
    for r in rows:
        assert 1 <= r["dynamic_sampling/rounds"] <= 3
        assert r["dynamic_sampling/groups_seen"] == target * r["dynamic_sampling/rounds"]
        full = r["dynamic_sampling/groups_kept"] >= target
        assert full or r["dynamic_sampling/rounds"] == 3  # a short batch only after the last round
        if full:  # dynamic sampling only keeps groups with reward variance: nothing left to drop
            assert r["filter/zero_variance_dropped"] == 0
        trained = 4 * min(target, r["dynamic_sampling/groups_kept"])
        assert r["filter/kept_samples"] == trained - r["filter/zero_variance_dropped"] - r["filter/overlong_dropped"]
    # The warm start taught the chat format: responses end with the end-of-turn token, well
    # before the length limit, so the overlong filter has (almost) nothing to drop.
    assert sum(r["filter/overlong_dropped"] for r in rows) <= 0.25 * sum(4 * target for _ in rows)
    assert evaluated[-1]["eval/accuracy"] >= 0.0 and "held-out accuracy" in proc.stderr


REWARD_MODULE = '''
import json, os

def score(completion, sample):  # partial credit: the share of the reference's characters written
    target = set(f"\\boxed{{{sample['answer']}}}")
    reward = len(target & set(completion)) / len(target)
    with open(os.environ["REWARD_LOG"], "a") as log:
        log.write(json.dumps({"sample": sample, "completion": completion, "reward": reward}) + "\\n")
    return reward
'''


def test_a_reward_function_by_path_and_critic_free_ppo(tmp_path, start):
    """task.reward=module:function scores every training response with the whole dataset row, and the
    loop trains with algorithm=ppo (critic-free GAE) on one sample per prompt, with an adaptive KL penalty
    in the reward: on the first step the policy is the reference (KL exactly 0), so the controller lowers
    the coefficient by the clipped 20% times 8 samples / horizon 100."""
    (tmp_path / "addition_reward.py").write_text(REWARD_MODULE)
    log = tmp_path / "rewards.jsonl"
    env = dict(_env(), PYTHONPATH=f"{REPO}:{tmp_path}", REWARD_LOG=str(log))
    run_dir = tmp_path / "run"
    args = _args(run_dir, start, "num_steps=2", "task.num_eval=0", "task.reward=addition_reward:score",
                 "algorithm=ppo", "rollout.n_samples_per_prompt=1", "global_batch_size=8", "algorithm.kl_coef=0.05",
                 "algorithm.kl_in_reward=true", "algorithm.kl_target=0.01", "algorithm.kl_horizon=100")
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows, calls = _metrics(run_dir), [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and len(calls) == 16  # no held-out prompts: no step 0 row
    assert all(set(c["sample"]) == {"question", "answer", "response"} for c in calls)
    for step, row in enumerate(rows):
        mine = calls[8 * step: 8 * step + 8]
        assert row["reward/mean"] == pytest.approx(sum(c["reward"] for c in mine) / 8)
        assert row["reward/verifier_errors"] == 0 and row["filter/kept_samples"] == 8
        assert len({c["reward"] for c in mine}) > 1 and row["grad_norm"] > 0  # whitened rewards that vary
    assert rows[0]["kl_reward/kl"] == 0.0 and rows[1]["kl_reward/kl"] > 0.0
    assert rows[0]["kl_reward/coef"] == 0.05 and rows[1]["kl_reward/coef"] == pytest.approx(0.05 * (1 - 0.2 * 8 / 100))


# The uninterrupted run four tests compare with: PPO as in RLHF, with a critic (whose weights and optimizer a
# checkpoint must carry) and an adaptive KL penalty in the reward (whose coefficient it must carry too), a
# checkpoint every step, rollouts dumped, one update per step.
PPO = ["algorithm=ppo", "algorithm.critic=true", "algorithm.critic_lr=1e-3", "algorithm.num_inner_updates=1",
       "algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true", "algorithm.kl_target=0.001", "algorithm.kl_horizon=64"]
UNINTERRUPTED = [f"num_steps={STEPS}", "checkpoint.save_every=1", "task.eval_every=2", *PPO,
                 "logging.dump_rollouts=true"]
CRITIC_KEYS = ("critic/value_loss", "critic/values", "critic/returns", "critic/grad_norm",
               "critic/explained_variance")


def _same(got: float, want: float) -> bool:
    return got == want or (math.isnan(got) and math.isnan(want))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, start) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = subprocess.run(_args(run_dir, start, *UNINTERRUPTED), env=_env(), capture_output=True, text=True,
                          timeout=800)
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir


def test_dumped_rollouts_replay_the_same_updates_without_generating(tmp_path, start, uninterrupted):
    """logging.dump_rollouts writes each step's samples; a run from the same start with rollout.replay_dir
    trains on them without a rollout phase and logs the same update metrics, bit for bit on CPU. (An
    evaluation after some steps runs the colocated rollout; a replayed step must not report its timings.)"""
    dumped, replayed = uninterrupted, tmp_path / "replayed"
    lines = [json.loads(line) for line in (dumped / "rollouts" / "step_00000002.jsonl").read_text().splitlines()]
    assert len(lines) == 32 and all(len(r["output_ids"]) == len(r["logprobs"]) for r in lines)
    assert all(r["response_text"] for r in lines) and {r["prompt_index"] for r in lines} == set(range(8))
    again = subprocess.run(_args(replayed, start, *UNINTERRUPTED, f"rollout.replay_dir={dumped / 'rollouts'}"),
                           env=_env(), capture_output=True, text=True, timeout=800)
    assert again.returncode == 0, again.stderr[-4000:]
    for want, got in zip(_metrics(dumped)[1:], _metrics(replayed)[1:], strict=True):  # row 0: evaluation only
        assert "time/sync_weights" in want and "time/sync_weights" not in got  # nothing generated
        for key in ("reward/mean", "loss", "grad_norm", "kl/policy_old_new", "entropy", "response_length/mean",
                    "rollout/logprob_mismatch", "kl_reward/coef", "kl_reward/kl", *CRITIC_KEYS):
            assert _same(got[key], want[key]), (want["step"], key, got[key], want[key])
    too_far = subprocess.run(_args(tmp_path / "far", start, f"num_steps={STEPS + 1}", "task.num_eval=4",
                                   f"rollout.replay_dir={dumped / 'rollouts'}"),
                             env=_env(), capture_output=True, text=True, timeout=120)
    assert too_far.returncode != 0
    assert f"has no rollouts of step {STEPS + 1} (it holds steps 1..{STEPS})" in too_far.stderr


def test_the_reference_policy_follows_the_policy_every_step(tmp_path, start, uninterrupted):
    """algorithm.ref_update_every=1: each step's reference is the policy that step starts from, so the KL
    of its (single) update is exactly 0; without it (the uninterrupted run) the KL to the start grows from
    the second step."""
    moving = tmp_path / "moving"
    proc = subprocess.run(_args(moving, start, "num_steps=3", "task.num_eval=0", "algorithm.kl_coef=0.05",
                                "algorithm.kl_estimator=k1", "algorithm.num_inner_updates=1",
                                "algorithm.ref_update_every=1"), env=_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["kl/ref"] for r in _metrics(moving)] == [0.0, 0.0, 0.0]
    fixed = _metrics(uninterrupted)[1:]  # row 0: the evaluation before any update
    # the KL to the start is 0 up to the first step whose update moved the policy (a step whose rewards all agree
    # has no gradient), and not 0 after it
    moved = next(i for i, r in enumerate(fixed) if r["grad_norm"] > 0)
    assert moved < len(fixed) - 1, [r["grad_norm"] for r in fixed]
    assert all(r["kl/ref"] == 0.0 for r in fixed[:moved + 1]) and all(r["kl/ref"] != 0.0 for r in fixed[moved + 1:])


def test_rl_loop_resumes_exactly_after_sigkill(tmp_path, start, uninterrupted):
    """A run SIGKILLed mid-way and started again logs the same per-step metrics as one never interrupted,
    with a critic (its weights, optimizer and schedule travel in the checkpoint: a critic started afresh
    from the policy would predict other values) and an adaptive KL penalty in the reward (its coefficient
    travels too: it would restart at kl_coef otherwise)."""
    resumed_dir = tmp_path / "resumed"
    args = _args(resumed_dir, start, *UNINTERRUPTED)
    run_until_killed(args, resumed_dir, lines=3)  # killed after step 2 was logged, maybe mid-step 3 or mid-save
    again = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=800)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from" in again.stderr
    reference, resumed = _metrics(uninterrupted), _metrics(resumed_dir)
    assert [r["step"] for r in resumed] == list(range(STEPS + 1))
    assert resumed[0] == reference[0]  # the evaluation before any update
    for want, got in zip(reference[1:], resumed[1:], strict=True):
        for key in ("reward/mean", "loss", "grad_norm", "kl/policy_old_new", "kl/ref", "entropy",
                    "response_length/mean", "weight_version", "kl_reward/coef", "kl_reward/kl", *CRITIC_KEYS):
            assert _same(got[key], want[key]), (want["step"], key, got[key], want[key])
        assert got.get("eval/accuracy") == want.get("eval/accuracy")
    coefs = [r["kl_reward/coef"] for r in reference[1:]]
    assert coefs[0] == 0.05 and len(set(coefs)) == STEPS  # it moved every step


def test_a_new_critic_changes_nothing_until_it_has_learned(tmp_path, start, uninterrupted):
    """The critic starts with a zero value head: its values are exactly 0 at step 1, so that step's update
    is the critic-free GAE's, bit for bit (same loss, gradient norm, clipping); then it learns (its values move
    after the first step with returns that are not all 0, its loss is finite) and its own metrics are logged
    every step."""
    free = tmp_path / "critic_free"
    args = [a for a in _args(free, start, *UNINTERRUPTED) if not a.startswith(("algorithm.critic",))]
    proc = subprocess.run([*args, "num_steps=1", "checkpoint.save_every=0", "logging.dump_rollouts=false"],
                          env=_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (_, want), rows = _metrics(free), _metrics(uninterrupted)[1:]  # row 0: the evaluation before any update
    assert "critic/value_loss" not in want
    for key in ("loss", "pg_loss", "grad_norm", "clip_frac", "entropy", "reward/mean"):
        assert rows[0][key] == want[key], (key, rows[0][key], want[key])
    ev = rows[0]["critic/explained_variance"]  # 1 - Var(R - 0) / Var(R), or nan for equal returns
    assert rows[0]["critic/values"] == 0.0 and (ev == 0.0 or math.isnan(ev))
    # it learns from the first step whose returns are not all 0 on: its values move after that step
    learned = next(i for i, r in enumerate(rows) if r["critic/returns"] != 0.0)
    assert learned < len(rows) - 1, [r["critic/returns"] for r in rows]
    assert all(r["critic/values"] != 0.0 for r in rows[learned + 1:])
    assert all(math.isfinite(r["critic/value_loss"]) for r in rows)
    assert rows[0]["critic/lr"] == 1e-3


def test_critic_warmup_trains_the_critic_alone(tmp_path, start, uninterrupted):
    """algorithm.critic_warmup_steps=1: step 1 updates the critic exactly as the uninterrupted run's step 1
    did (same rollouts, same critic) and leaves the policy alone (no policy metrics); step 2 updates both."""
    warmup = tmp_path / "warmup"
    proc = subprocess.run([*_args(warmup, start, *PPO), "num_steps=2", "task.num_eval=0",
                           "algorithm.critic_warmup_steps=1"], env=_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows, want = _metrics(warmup), _metrics(uninterrupted)[1]
    assert "pg_loss" not in rows[0] and "pg_loss" in rows[1]
    assert "tokens_per_s" not in rows[0] and rows[1]["tokens_per_s"] > 0  # no policy update: no throughput
    for key in CRITIC_KEYS:
        assert _same(rows[0][key], want[key]), (key, rows[0][key], want[key])


def test_tests_verifier_runs_a_rows_tests_in_the_sandbox(tmp_path):
    from megatron_rl.config import TaskConfig
    from megatron_rl.data.tasks import Task
    from megatron_rl.data.tokenizer import load_tokenizer

    tests = [{"name": "adds", "argv": ["python3", "-c", "from solution import add; assert add(2, 3) == 5"]},
             {"name": "negative", "argv": ["python3", "-c", "from solution import add; assert add(-1, 1) == 0"]}]
    rows = [{"prompt": "def add(a, b):", "tests": tests}] * 3
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = Task(TaskConfig(name="code", type="dataset", path=str(path), num_eval=1), load_tokenizer("builtin:char"))
    meta = task.prompts("train")[0].meta
    candidates = ["def add(a, b):\n    return a + b\n",  # both pass
                  "def add(a, b):\n    return 5\n",  # only the first passes
                  "def add(a, b):\n    while True: pass\n"]  # killed by the limits: none pass

    async def score(address: str) -> list[float]:  # the gRPC channel lives on this loop
        verifier = task.verifier_factory([address])()
        verifier.limits = {"wall_time_s": 30, "cpu_time_s": 2}  # the loop meets the CPU limit; wall time is slack
        return await verifier.score([(meta, c) for c in candidates])

    server = start_server("bwrap" if runtime_args("bwrap") else "process")
    try:
        rewards = asyncio.run(score(server.address))
    finally:
        server.stop()
    assert rewards == [1.0, 0.5, 0.0]


def test_env_pool_retires_trivial_tasks_and_the_audit_writes_reviews(tmp_path):
    """Every prompt's answer is 7: after the warm start the policy solves them, so the pool
    (refreshed every step) retires them as trivial and injects queued ones; the audit writes
    the step's top trajectories."""
    rows = [{"question": f"q{i}:", "answer": 7, "response": "\\boxed{7}"} for i in range(40)]
    data, queue = tmp_path / "sevens.jsonl", tmp_path / "queue.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    queue.write_text("".join(json.dumps(dict(r, question=f"new{i}:")) + "\n" for i, r in enumerate(rows[:20])))
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "megatron_rl.train", "+experiment=demo_countdown", "task=arithmetic", "task.type=dataset",
            f"task.path={data}", "task.prompt_key=question", "task.num_eval=4", "task.eval_samples=1",
            "task.eval_every=0", "task.sft_warmup_steps=30", f"run_dir={run_dir}", "num_steps=3",
            "global_batch_size=32", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=10",  # \\boxed{7}
            "task.pool_refresh_every=1", f"task.pool_queue_path={queue}", "task.pool_min_samples=4",
            "task.pool_trivial_pass_rate=0.75", "logging.audit_every=1", "logging.audit_samples=3",
            "logging.progress=false"]
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows_out = _metrics(run_dir)[1:]  # row 0: the evaluation before any update
    solved = [r["reward/mean"] for r in rows_out]
    assert max(solved) >= 0.25, solved  # the warm start taught the constant answer (often)
    retired = [r["env_pool/retired_total"] for r in rows_out]
    assert retired == sorted(retired) and retired[-1] > 0 and "env pool: retired" in proc.stderr
    assert rows_out[-1]["env_pool/queue"] == 20 - retired[-1]
    audits = sorted((run_dir / "audit").glob("step_*.jsonl"))
    assert [a.name for a in audits] == ["step_00000001.jsonl", "step_00000002.jsonl", "step_00000003.jsonl"]
    records = [json.loads(line) for line in audits[-1].read_text().splitlines()]
    assert len(records) == 3 and [r["reward"] for r in records] == sorted((r["reward"] for r in records), reverse=True)
