"""Pooling repeated training runs (`evaluation/pooling.py`, `python -m megatron_rl.eval --pool`):
run values, the interval over runs and the Welch comparison of two groups, against values
worked out here from the raw rewards and the textbook formulas."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_rl.evaluation.pooling import pool_runs, run_value, welch

T_975_DF2 = 4.302652729749464  # Student t quantile 0.975 with 2 degrees of freedom (tables)
PROMPTS, SAMPLES, SEEDS = 4, 3, 2


def _records(rewards: np.ndarray, step: int, domains=("",)) -> list[dict]:
    """rewards[seed, prompt, sample] in {0, 1} -> records of one checkpoint."""
    out = []
    for seed in range(rewards.shape[0]):
        for p in range(rewards.shape[1]):
            for s in range(rewards.shape[2]):
                r = float(rewards[seed, p, s])
                out.append({"set": "heldout", "checkpoint": f"step_{step:08d}", "step": step, "seed": seed,
                            "prompt": p, "sample": s, "domain": domains[p % len(domains)], "reward": r,
                            "correct": r >= 1})
    return out


def _run_rewards(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random((SEEDS, PROMPTS, SAMPLES)) < 0.3 + 0.1 * seed).astype(float)


def _write(tmp_path, name: str, records: list[dict]):
    d = tmp_path / name
    d.mkdir()
    (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


def _pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _expected(rewards: np.ndarray, k: int) -> tuple[float, float]:
    """(accuracy, pass@k) of one run: each seed's value, averaged over seeds."""
    acc = float(rewards.mean(axis=(1, 2)).mean())
    passk = np.mean([[_pass_at_k(SAMPLES, int(rewards[s, p].sum()), k) for p in range(PROMPTS)]
                     for s in range(SEEDS)], axis=1).mean()
    return acc, float(passk)


def test_run_value_is_the_seed_mean_at_the_latest_step_unless_chosen():
    early, late = _run_rewards(0), _run_rewards(1)
    records = _records(early, 0) + _records(late, 10)
    got = run_value(records, ks=[1, 3])
    assert got["step"] == 10 and got["checkpoint"] == "step_00000010"
    acc, pass3 = _expected(late, 3)
    assert got["metrics"]["accuracy"] == pytest.approx(acc)
    assert got["metrics"]["pass@3"] == pytest.approx(pass3)
    assert run_value(records, ks=[1], step=0)["metrics"]["accuracy"] == pytest.approx(_expected(early, 1)[0])
    with pytest.raises(ValueError, match="step 5 was not evaluated"):
        run_value(records, ks=[1], step=5)
    with pytest.raises(ValueError, match="no records of set 'regression'"):
        run_value(records, ks=[1], set_name="regression")


def test_two_checkpoints_of_one_step_are_not_pooled_and_a_lost_seed_is_left_out():
    """A training checkpoint and its HF export at one step would mix their samples into one value: refused.
    A seed whose every sample was lost has no value: the run's value is its other seeds' mean, not nan."""
    rewards = _run_rewards(2)
    export = [dict(r, checkpoint="hf/step_00000010") for r in _records(rewards, 10)]
    with pytest.raises(ValueError, match="step 10 has records of several checkpoints .*hf/step_00000010"):
        run_value(_records(rewards, 10) + export, ks=[1])
    records = [dict(r, lost=True) if r["seed"] == 1 else r for r in _records(rewards, 10)]
    got = run_value(records, ks=[1, 3])["metrics"]
    assert got["accuracy"] == pytest.approx(float(rewards[0].mean()))
    assert got["pass@3"] == pytest.approx(np.mean([_pass_at_k(SAMPLES, int(rewards[0, p].sum()), 3)
                                                   for p in range(PROMPTS)]))


def test_interval_over_runs_and_welch_comparison(tmp_path):
    a = [_write(tmp_path, f"a{i}", _records(_run_rewards(i), 20)) for i in range(3)]
    b = [_write(tmp_path, f"b{i}", _records(_run_rewards(10 + i), 20)) for i in range(3)]
    result = pool_runs({"a": a, "b": b}, ks=[1, 2])
    values_a = np.array([_expected(_run_rewards(i), 1)[0] for i in range(3)])
    values_b = np.array([_expected(_run_rewards(10 + i), 1)[0] for i in range(3)])
    pooled = result["groups"]["a"]["pooled"]["accuracy"]
    half = T_975_DF2 * values_a.std(ddof=1) / math.sqrt(3)
    assert pooled["mean"] == pytest.approx(values_a.mean())
    assert (pooled["low"], pooled["high"]) == pytest.approx((values_a.mean() - half, values_a.mean() + half))
    assert [r["metrics"]["accuracy"] for r in result["groups"]["b"]["runs"]] == pytest.approx(values_b.tolist())
    # Welch by hand: standard error, Satterthwaite degrees of freedom, t quantile and p-value
    from scipy import stats

    va, vb = values_a.var(ddof=1) / 3, values_b.var(ddof=1) / 3
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)
    diff = values_b.mean() - values_a.mean()
    se = math.sqrt(va + vb)
    got = result["comparison"]["accuracy"]
    assert got["difference"] == pytest.approx(diff)
    assert got["df"] == pytest.approx(df)
    q = stats.t.ppf(0.975, df)
    assert (got["low"], got["high"]) == pytest.approx((diff - q * se, diff + q * se))
    assert got["p_value"] == pytest.approx(2 * stats.t.sf(abs(diff) / se, df))


def test_welch_needs_two_runs_a_side_and_handles_constant_groups():
    with pytest.raises(ValueError, match=">= 2 runs in each"):
        welch([0.5], [0.6, 0.7])
    same = welch([0.5, 0.5], [0.5, 0.5])
    assert same["difference"] == 0 and same["p_value"] is None and not same["significant"]
    apart = welch([0.5, 0.5], [0.52, 0.52])  # no spread on either side is no evidence of a difference
    assert apart["difference"] == pytest.approx(0.02) and apart["p_value"] is None and not apart["significant"]
    assert apart["low"] is None and apart["high"] is None


def test_domains_are_pooled_and_compared_per_domain(tmp_path):
    def dirs(name, seeds):
        return [_write(tmp_path, f"{name}{i}", _records(_run_rewards(i), 5, domains=("math", "code"))) for i in seeds]

    result = pool_runs({"pool": dirs("a", [0, 1]), "against": dirs("b", [4, 5, 6])}, ks=[1])
    for domain, prompts in (("math", [0, 2]), ("code", [1, 3])):
        def value(i):
            return float(_run_rewards(i)[:, prompts].mean(axis=(1, 2)).mean())

        a, b = [value(i) for i in (0, 1)], [value(i) for i in (4, 5, 6)]
        assert result["groups"]["pool"]["domains"][domain]["accuracy"]["mean"] == pytest.approx(np.mean(a))
        assert result["domain_comparison"][domain]["accuracy"]["difference"] == pytest.approx(np.mean(b) - np.mean(a))


def test_cli_writes_the_pooled_report_and_refuses_bad_input(tmp_path, capsys):
    from megatron_rl.eval import main

    a = [str(_write(tmp_path, f"a{i}", _records(_run_rewards(i), 20))) for i in range(3)]
    b = [str(_write(tmp_path, f"b{i}", _records(_run_rewards(10 + i), 20))) for i in range(2)]
    out = tmp_path / "out"
    main(["--pool", *a, "--against", *b, "--pass-k", "1", "3", "--out", str(out)])
    result = json.loads((out / "pooled.json").read_text())
    assert set(result["comparison"]) == {"accuracy", "pass@1", "pass@3", "truncated"}
    text = (out / "pooled.md").read_text()
    assert "## pool: 3 runs" in text and "## against - pool (Welch)" in text
    for argv, words in ((["--pool", str(tmp_path / "missing")], "holds no records.jsonl"),
                        (["--pool", *a, "--pass-k", "4"], "each k must be in 1..3"),
                        (["--pool", *a, "--run", a[0]], "either --run"),
                        (["--run", a[0], "--against", *b], "go with --pool"),
                        (["--pool", *a, "task.num_eval=3"], "no key=value overrides")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert words in capsys.readouterr().err
