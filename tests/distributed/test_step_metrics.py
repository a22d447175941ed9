"""What an RL run logs says what it is: a short run of the main job on two gloo ranks (task=arithmetic, a reward
function that gives no verdict on rank 1), started from the fork server (tests/distributed/launcher.py).

- Counts each rank takes on its own share of the prompts (`reward/unscored`, `reward/verifier_errors`,
  `reward/verifier_calls`) are the totals over both ranks, not rank 0's; so is `rollout/generated_tokens`.
- One step number everywhere: a row's `step` is the updates done when it was written; the evaluation
  before any update is row 0; the log's `step k` and `eval at step k` lines, the metrics.jsonl rows, the
  TensorBoard events and the checkpoints agree.
- The KL metrics are named by what they compare, and the end-of-run line names the steps it averages
  and no warm start that did not run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS, EVAL_EVERY = 3, 2
BATCH, N = 16, 4  # 4 prompts a step: each of the 2 ranks generates and scores 2 of them, 8 samples
REWARD_MODULE = '''
import os


def score(completion, sample):
    if os.environ["RANK"] == "1":
        raise RuntimeError("no verdict on rank 1")
    return float(sum(map(ord, completion)) % 2)  # varies within a group: the groups train
'''


def _train(rank: int, world_size: int, run_dir: str, module_dir: str) -> None:
    sys.path.insert(0, module_dir)
    from megatron_rl.train import main

    main(["mode=rl", "task=arithmetic", "task.reward=rank_reward:score", f"run_dir={run_dir}", f"num_steps={STEPS}",
          "cluster.device=cpu", f"global_batch_size={BATCH}", f"rollout.n_samples_per_prompt={N}",
          "rollout.max_new_tokens=8", "task.num_train=64", "task.num_eval=4", f"task.eval_every={EVAL_EVERY}",
          "task.eval_samples=1", "algorithm.kl_coef=0.01", "algorithm.filter_zero_variance=false",
          "checkpoint.save_every=1", "checkpoint.keep_last=5", "logging.log_every=1", "logging.progress=false"])


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict], str]:
    root = tmp_path_factory.mktemp("step_metrics")
    (root / "rank_reward.py").write_text(REWARD_MODULE)
    run_dir = root / "run"
    run_spawned(_train, 2, str(run_dir), str(root), timeout_s=500)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows, (run_dir / "logs" / "rank0.log").read_text()


def test_counts_are_summed_over_the_ranks(run):
    _, rows, _ = run
    trained = [r for r in rows if "reward/mean" in r]
    assert len(trained) == STEPS
    per_rank = BATCH // 2  # samples a rank scores per step
    for row in trained:
        assert row["reward/unscored"] == per_rank, row  # rank 1's samples, all of them
        assert row["reward/verifier_errors"] == per_rank, row
        assert row["reward/verifier_calls"] == 2, row  # a reward call per engine call: one per rank
        assert row["reward/timeouts"] == 0 and row["reward/failed_batches"] == 0
        assert row["filter/dropped_episodes"] == per_rank  # from the gathered rollouts: global before too
        # every rank's tokens, not rank 0's share: the mean response length is over all the step's samples
        assert row["rollout/generated_tokens"] == pytest.approx(row["response_length/mean"] * BATCH), row
        assert row["rollout/tokens_per_s"] == pytest.approx(row["rollout/generated_tokens"] / row["time/generate_only"])


def test_log_lines_rows_tensorboard_and_checkpoints_agree(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, rows, log = run
    evaluated = sorted({0, *range(EVAL_EVERY, STEPS + 1, EVAL_EVERY), STEPS})
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert set(rows[0]) == {  # before updates
        "step", "eval/accuracy", "eval/pass@k", "eval/samples", "eval/lost", "eval/truncated"}
    assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "eval/accuracy" in r] == evaluated
    logged_steps = [int(s) for s in re.findall(r"INFO megatron_rl\.rl\.loop: step (\d+) \|", log)]
    assert logged_steps == list(range(1, STEPS + 1))
    assert [int(s) for s in re.findall(r"eval at step (\d+): accuracy", log)] == evaluated
    for row in rows:  # each eval line's accuracy is its row's
        if "eval/accuracy" in row:
            assert f"eval at step {row['step']}: accuracy {row['eval/accuracy']:.3f}" in log
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == list(range(1, STEPS + 1))
    assert [e.step for e in acc.Scalars("eval/accuracy")] == evaluated
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step_{STEPS:08d}"
    for row in rows[1:]:  # the checkpoint after step k is step_k and records step k's row
        meta = json.loads((checkpoints / f"step_{row['step']:08d}" / "meta.json").read_text())
        assert meta["step"] == row["step"] and meta["metrics"]["reward/mean"] == row["reward/mean"]


def test_metric_names_and_the_summary_say_what_they_are(run):
    _, rows, log = run
    for row in rows[1:]:
        assert {"kl/policy_old_new", "kl/policy_old_new_first_update", "kl/ref"} <= set(row), sorted(row)
        assert not {"ppo_kl", "kl", "ppo_kl_first_update"} & set(row)
    assert rows[1]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the reference
    assert re.search(r"megatron_rl\.rl\.loop: step 1 \| .*\| kl_old_new \S+ \| kl_ref \S+ \|", log)
    (summary,) = [line for line in log.splitlines() if "training reward" in line]
    assert "over step 1 -> " in summary and f"over step {STEPS}" in summary  # a tenth of 3 steps: 1 each
    assert f"held-out accuracy {rows[0]['eval/accuracy']:.3f} at step 0 -> " in summary
    assert f"at step {STEPS};" in summary and "warm start" not in summary
