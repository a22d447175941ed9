"""The offline evaluation's files from planted records: two checkpoints, two domains, a
candidate that solves every prompt the baseline solves and more (so the comparison must call
it significantly better overall and in the domain it gained, not in the other), and the checkpoint
selectors' errors."""

from __future__ import annotations

import json

import pytest

from megatron_rl.evaluation.report import write_report
from megatron_rl.evaluation.runner import Checkpoint, EvalSpec, resolve_checkpoints


def _records(name: str, step: int, solved: set[int], num_prompts: int = 40, seeds: int = 3, samples: int = 2):
    return [{"set": "heldout", "checkpoint": name, "step": step, "seed": seed, "prompt": p, "sample": s,
             "domain": "math" if p % 2 else "code", "reward": float(p in solved), "correct": p in solved}
            for seed in range(seeds) for p in range(num_prompts) for s in range(samples)]


def test_report_files_from_planted_records(tmp_path):
    base, better = set(range(0, 40, 4)), set(range(0, 40, 4)) | set(range(1, 40, 2))
    records = _records("step_00000010", 10, base) + _records("step_00000020", 20, better)
    spec = EvalSpec(run="RUN", checkpoints=(Checkpoint("step_00000010", "/a", "train", 10),
                                            Checkpoint("step_00000020", "/b", "train", 20)),
                    out_dir=str(tmp_path), num_seeds=3, ks=(1, 2), num_resamples=2000)
    summary = write_report(tmp_path, records, spec)
    first = summary["checkpoints"][0]["sets"]["heldout"]
    assert first["metrics"]["accuracy"]["seeds"]["mean"] == pytest.approx(10 / 40)
    assert first["domains"]["code"]["metrics"]["accuracy"]["seeds"]["mean"] == pytest.approx(10 / 20)
    assert first["domains"]["math"]["metrics"]["accuracy"]["seeds"]["mean"] == 0.0
    comparison = json.loads((tmp_path / "comparison.json").read_text())
    (c,) = comparison["comparisons"]
    assert (c["baseline"], c["candidate"]) == ("step_00000010", "step_00000020")
    acc = c["metrics"]["accuracy"]
    assert acc["difference"] == pytest.approx(20 / 40) and acc["significant"] and acc["p_value"] < 1e-3
    # per domain: the candidate gained every math prompt (odd) and the code prompts (even) are unchanged
    math_acc, code_acc = c["domains"]["math"]["accuracy"], c["domains"]["code"]["accuracy"]
    assert math_acc["difference"] == pytest.approx(1.0) and math_acc["significant"]
    assert code_acc["difference"] == 0.0 and not code_acc["significant"]
    report = (tmp_path / "report.md").read_text()
    assert "### Domain `math`" in report and "### Domain `code`" in report
    assert "| heldout | step_00000020 | accuracy | +0.500 |" in report
    assert "| heldout, domain `math` | step_00000020 | accuracy | +1.000 |" in report
    assert (tmp_path / "accuracy.png").stat().st_size > 1000


def test_checkpoint_selectors(tmp_path):
    for step in (1, 2):
        d = tmp_path / "checkpoints" / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"step": step}))
    (tmp_path / "checkpoints" / "latest").write_text("step_00000002")
    hf = tmp_path / "hf" / "step_00000002"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    names = [c.name for c in resolve_checkpoints(tmp_path, ["latest", "all", "hf", "1"])]
    assert names == ["step_00000002", "step_00000001", "hf/step_00000002"]  # in order, duplicates dropped
    with pytest.raises(ValueError, match="neither a complete training checkpoint"):
        resolve_checkpoints(tmp_path, ["5"])
    with pytest.raises(ValueError, match="found no checkpoint"):
        resolve_checkpoints(tmp_path / "empty", ["all"])
    # step 1 of another run: named after its run, not pooled with this run's step 1
    other = tmp_path / "other" / "checkpoints" / "step_00000001"
    other.mkdir(parents=True)
    (other / "meta.json").write_text(json.dumps({"step": 1}))
    names = [c.name for c in resolve_checkpoints(tmp_path, ["1", str(other)])]
    assert names == [f"{tmp_path.name}/step_00000001", "other/step_00000001"]


def test_agent_episodes_get_turn_and_ending_statistics(tmp_path):
    """Records of agent episodes (`turns`, `ended`) add an `episodes` block to their set's summary
    (and to their domain's) and a table to the report; single-turn records add none. Expected
    values counted by hand from the planted records below."""
    rows = []
    # 4 prompts x 2 samples, one seed: (turns, ended, solved) per sample
    plan = [(1, "submitted", True), (3, "max_turns", False), (2, "submitted", True), (3, "max_turns", False),
            (2, "max_tokens", False), (1, "submitted", True), (3, "submitted", True), (2, "dropped", False)]
    for i, (turns, ended, solved) in enumerate(plan):
        rows.append({"set": "heldout", "checkpoint": "step_00000005", "step": 5, "seed": 0, "prompt": i // 2,
                     "sample": i % 2, "domain": "agent", "reward": float(solved), "correct": solved,
                     "turns": turns, "ended": ended})
    rows += [{"set": "heldout", "checkpoint": "step_00000005", "step": 5, "seed": 0, "prompt": 10 + p, "sample": s,
              "domain": "math", "reward": 1.0, "correct": True} for p in range(2) for s in range(2)]
    spec = EvalSpec(run="RUN", checkpoints=(Checkpoint("step_00000005", "/a", "train", 5),), out_dir=str(tmp_path),
                    num_seeds=1, ks=(1,), num_resamples=200)
    heldout = write_report(tmp_path, rows, spec)["checkpoints"][0]["sets"]["heldout"]
    episodes = heldout["episodes"]
    assert episodes["num_episodes"] == 8
    assert episodes["turns_mean"] == pytest.approx((1 + 3 + 2 + 3 + 2 + 1 + 3 + 2) / 8)
    assert episodes["turns"] == {"1": 2, "2": 3, "3": 3}
    assert episodes["ended"] == {"dropped": 1 / 8, "max_tokens": 1 / 8, "max_turns": 2 / 8, "submitted": 4 / 8}
    assert episodes["turns_mean_solved"] == pytest.approx((1 + 2 + 1 + 3) / 4)
    assert heldout["domains"]["agent"]["episodes"] == episodes and "episodes" not in heldout["domains"]["math"]
    report = (tmp_path / "report.md").read_text()
    assert "| checkpoint | turns (mean) | turns, solved episodes | dropped | max_tokens | max_turns | submitted |" \
        in report
    assert "| step_00000005 | 2.12 | 1.75 | 12% | 12% | 25% | 50% |" in report
