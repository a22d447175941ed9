"""algorithm.old_logprobs=current (the default) takes the old log-probs from the first update's own forward instead
of a forward of their own, and keeps them for the later inner updates: the same weights give the same numbers, so
a step must train exactly as with old_logprobs=recompute. Two runs of the main job on two gloo ranks (data
parallel), one step of two inner updates each from the same start, compared metric by metric (the metrics are the
second update's, whose importance ratio reads the kept log-probs); the recompute run spends a forward on them
(`time/logprobs`), the current one none."""

from __future__ import annotations

import json
import math
from pathlib import Path
import pytest

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


REWARD_MODULE = """
def score(completion, sample):
    return float(sum(map(ord, completion)) % 2)  # varies within a group: every group trains
"""


def _train(rank: int, world_size: int, run_dir: str, mode: str, module_dir: str) -> None:
    import sys

    sys.path.insert(0, module_dir)
    from megatron_rl.train import main

    main(["mode=rl", "task=arithmetic", "task.reward=parity_reward:score", f"run_dir={run_dir}", "num_steps=1", "cluster.device=cpu",
          "global_batch_size=16", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=12", "task.num_train=64",
          "task.num_eval=0", "task.sft_warmup_steps=3", "algorithm.filter_zero_variance=false", "optimizer.lr=3e-3",
          "algorithm.num_inner_updates=2",
          f"algorithm.old_logprobs={mode}", "checkpoint.save_every=0", "logging.progress=false", "seed=3"])


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    found = {}
    root = tmp_path_factory.mktemp("old_logprobs")
    (root / "parity_reward.py").write_text(REWARD_MODULE)
    for mode in ("recompute", "current"):
        run_dir = root / mode
        run_spawned(_train, 2, str(run_dir), mode, str(root), timeout_s=500)
        found[mode] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
        assert "old_logprobs: " + mode in (run_dir / "config.yaml").read_text()
    return found


def test_a_step_trains_as_with_a_forward_of_their_own(rows):
    recompute, current = rows["recompute"], rows["current"]
    assert recompute["step"] == current["step"] == 1
    assert recompute["reward/mean"] == current["reward/mean"]  # the same samples: generated before the update
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "rollout/logprob_mismatch", "mismatch_k1", "tis_weight",
                "ratio", "kl/policy_old_new", "clip_frac"):
        assert math.isclose(recompute[key], current[key], rel_tol=1e-4, abs_tol=1e-7), (key, recompute[key],
                                                                                        current[key])
    assert recompute["grad_norm"] > 0 and recompute["rollout/logprob_mismatch"] > 0
    # the second update's policy has moved: its ratio to the kept old log-probs is no longer 1
    assert recompute["kl/policy_old_new"] > 1e-6 and abs(recompute["ratio"] - 1.0) > 1e-5
    assert current["kl/policy_old_new_first_update"] == 0.0  # exactly: the first update's old is its own forward's
    assert abs(recompute["kl/policy_old_new_first_update"]) < 1e-7


def test_only_recompute_spends_a_forward_on_them(rows):
    assert rows["current"]["time/logprobs"] < 0.2 * rows["recompute"]["time/logprobs"]


def test_auto_is_current_unless_something_needs_them_before_the_update():
    from megatron_rl.config import load_config

    for extra in ([], ["algorithm.num_inner_updates=2"]):
        assert load_config(["mode=rl", *extra], world_size=1).algorithm.old_logprobs == "current"
    assert load_config(["mode=rl", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.01"],
                       world_size=1).algorithm.old_logprobs == "recompute"


def _reduce(rank: int, world_size: int, out: str) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from megatron_rl.trainer.core import _reduce_metrics

    dist.init_process_group("gloo")
    groups = SimpleNamespace(dp_size=2, cp_size=1, is_last_stage=True, dp_cp_group=dist.group.WORLD, pp_size=1,
                             device=torch.device("cpu"))
    stored = ([{"loss": 1.0, "max/mismatch": 3.0}, {"loss": 2.0, "max/mismatch": 0.5}, {}] if rank == 0 else
              [{"loss": 4.0, "max/mismatch": 7.0}])
    got = _reduce_metrics(stored, groups)
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.destroy_process_group()


def test_max_metrics_are_maxima_over_micro_batches_and_ranks(tmp_path):
    """"max/<name>" metrics are reduced with max (over a rank's micro-batches, then the data-parallel ranks),
    the others summed; a padding row that reports nothing counts for neither."""
    run_spawned(_reduce, 2, str(tmp_path / "out.json"), timeout_s=120)
    assert json.loads((tmp_path / "out.json").read_text()) == {"loss": 7.0, "max/mismatch": 7.0}
