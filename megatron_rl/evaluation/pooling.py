"""Repeated training runs pooled into one interval, the run being the unit of replication.

One run's evaluation intervals (over sampling seeds, over prompts; `stats.py`) say how precisely
that run was measured, not how much the result depends on the training seed, and RL results
often depend on it a lot. Given the offline evaluations of R runs trained the same way with
different seeds (`python -m megatron_rl.eval` in each), every run contributes one value per
metric: its accuracy / pass@k at the chosen checkpoint, the mean over its evaluation seeds. The
pooled value is the mean over runs with a Student-t interval over runs (R - 1 degrees of
freedom; `stats.t_interval`). Two groups of runs (say, two methods) are compared with Welch's t
test and interval on their run values, overall and per domain: unpaired (the runs are independent) and without assuming
equal variances. Sampling and prompt noise are inside each run value, so they are counted too.

    python -m megatron_rl.eval --pool A1/eval/final A2/eval/final A3/eval/final \\
        [--against B1/eval/final B2/eval/final B3/eval/final] [--step latest|STEP] [--set heldout]

No library takes evaluation directories to run-level intervals; the statistics themselves are
scipy's (t quantiles, Welch's test).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_rl.evaluation.records import eval_metrics
from megatron_rl.evaluation.stats import group_by, t_interval

HELD_OUT = "heldout"


def load_records(eval_dir: str | Path) -> list[dict[str, Any]]:
    """The per-sample records an offline evaluation wrote (`EVAL_DIR/records.jsonl`)."""
    path = Path(eval_dir) / "records.jsonl"
    if not path.is_file():
        raise ValueError(f"{eval_dir} holds no records.jsonl: pass the output directories of "
                         f"`python -m megatron_rl.eval` (RUN/eval/NAME)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} is empty: its evaluation did not finish")
    return records


def samples_per_prompt(records: Sequence[dict[str, Any]]) -> int:
    """The fewest samples any prompt got in one seed (the largest k pass@k allows)."""
    per = group_by(records, lambda r: (r.get("set"), r.get("checkpoint"), r.get("seed", 0), r["prompt"]))
    return min(len(rows) for rows in per.values())


def run_value(records: Sequence[dict[str, Any]], ks: Sequence[int], step: Optional[int] = None,
              set_name: str = HELD_OUT) -> dict[str, Any]:
    """One run's value per metric at one checkpoint: the mean over evaluation seeds of each seed's
    metric (`records.eval_metrics`), overall and per domain. `step=None`: the latest step
    evaluated."""
    rows = [r for r in records if r.get("set", HELD_OUT) == set_name]
    if not rows:
        sets = sorted({str(r.get("set")) for r in records})
        raise ValueError(f"no records of set {set_name!r} (the evaluation has {', '.join(sets)})")
    steps = sorted({r["step"] for r in rows if r.get("step") is not None})
    chosen = steps[-1] if step is None and steps else step
    if chosen not in steps:
        raise ValueError(f"step {step} was not evaluated (steps {', '.join(map(str, steps)) or 'none'})")
    rows = [r for r in rows if r.get("step") == chosen]
    checkpoints = sorted({str(r.get("checkpoint")) for r in rows})
    if len(checkpoints) > 1:  # e.g. a training checkpoint and its HF export: pooled, their samples would mix
        raise ValueError(f"step {chosen} has records of several checkpoints ({', '.join(checkpoints)}): pool "
                         "evaluations of one checkpoint per run (evaluate the others into another directory)")
    out = {"checkpoint": rows[0].get("checkpoint"), "step": chosen, "metrics": _seed_mean(rows, ks)}
    domains = group_by(rows, lambda r: r.get("domain", ""))
    if len(domains) > 1:
        out["domains"] = {d: _seed_mean(d_rows, ks) for d, d_rows in sorted(domains.items())}
    return out


def _seed_mean(rows: Sequence[dict[str, Any]], ks: Sequence[int]) -> dict[str, float]:
    """Each metric's mean over the seeds where it is defined (a seed whose samples were all lost has nan), as
    `records.summarize` takes it; nan when no seed has it."""
    per_seed = [eval_metrics(seed_rows, ks) for seed_rows in group_by(rows, lambda r: r.get("seed", 0)).values()]
    out = {}
    for name in per_seed[0]:
        values = [m[name] for m in per_seed if not math.isnan(m[name])]
        out[name] = sum(values) / len(values) if values else float("nan")
    return out


def welch(baseline: Sequence[float], candidate: Sequence[float], confidence: float = 0.95) -> dict[str, Any]:
    """`mean(candidate) - mean(baseline)` over two independent groups of run values: Welch's
    interval (Satterthwaite degrees of freedom) and two-sided p-value. Needs >= 2 runs a side."""
    from scipy import stats

    if len(baseline) < 2 or len(candidate) < 2:
        raise ValueError(f"comparing groups of runs needs >= 2 runs in each, got {len(baseline)} and {len(candidate)}")
    difference = sum(candidate) / len(candidate) - sum(baseline) / len(baseline)
    if len(set(baseline)) == 1 and len(set(candidate)) == 1:
        # no spread in either group: no test (scipy's is nan too), and no difference is shown significant
        p_value, low, high, df = math.nan, math.nan, math.nan, math.nan
    else:
        with warnings.catch_warnings():  # one constant group (e.g. pass@k = 1 in every run) is fine for
            warnings.filterwarnings("ignore", "Precision loss occurred", RuntimeWarning)  # Welch: its variance is 0
            result = stats.ttest_ind(candidate, baseline, equal_var=False)
        ci = result.confidence_interval(confidence)
        p_value, low, high, df = float(result.pvalue), float(ci.low), float(ci.high), float(result.df)
    return json_safe({"difference": difference, "low": low, "high": high, "p_value": p_value, "df": df,
                      "significant": bool(p_value < 1 - confidence),
                      "no_spread": len(set(baseline)) == 1 and len(set(candidate)) == 1,
                      "alpha": 1 - confidence, "method": "welch-t"})  # nan (no test) as None, as intervals write it


def pool_runs(groups: dict[str, Sequence[str | Path]], ks: Optional[Sequence[int]] = None,
              step: Optional[int] = None, set_name: str = HELD_OUT, confidence: float = 0.95) -> dict[str, Any]:
    """Per group: each run's value and the mean over runs with its t interval (overall and per
    domain); with two groups, the second minus the first per metric (Welch). `ks` of pass@k:
    each at most the samples per prompt the evaluations drew (n); default 1 and n."""
    records = {d: load_records(d) for dirs in groups.values() for d in dirs}  # each file read once
    n = min(samples_per_prompt(r) for r in records.values())
    ks = tuple(dict.fromkeys(ks or [1, n]))
    if any(not 1 <= k <= n for k in ks):
        raise ValueError(f"--pass-k {' '.join(map(str, ks))} is invalid: the evaluations drew {n} samples per "
                         f"prompt, so each k must be in 1..{n}")
    names = ["accuracy", *(f"pass@{k}" for k in ks), "truncated"]
    out: dict[str, Any] = {"set": set_name, "confidence": confidence, "groups": {}}
    for group, dirs in groups.items():
        runs = [{"eval_dir": str(d), **run_value(records[d], ks, step, set_name)} for d in dirs]
        pooled = {m: t_interval([r["metrics"][m] for r in runs], confidence).to_dict() for m in names}
        entry: dict[str, Any] = {"runs": runs, "pooled": pooled}
        domains = sorted({d for r in runs for d in r.get("domains", {})})
        if domains:
            missing = [r["eval_dir"] for r in runs if set(r.get("domains", {})) != set(domains)]
            if missing:
                raise ValueError(f"runs of group {group!r} cover different domains ({', '.join(missing)} differ "
                                 f"from {', '.join(domains)}): pool evaluations of the same task mix")
            entry["domains"] = {d: {m: t_interval([r["domains"][d][m] for r in runs], confidence).to_dict()
                                    for m in names} for d in domains}
        out["groups"][group] = entry
    if len(groups) == 2:
        first, second = (out["groups"][g]["runs"] for g in groups)
        out["comparison"] = {m: welch([r["metrics"][m] for r in first], [r["metrics"][m] for r in second],
                                      confidence) for m in names}
        shared = sorted(set.intersection(*(set(out["groups"][g].get("domains", {})) for g in groups)))
        if shared:
            out["domain_comparison"] = {d: {m: welch([r["domains"][d][m] for r in first],
                                                     [r["domains"][d][m] for r in second], confidence)
                                            for m in names} for d in shared}
    return out


def json_safe(value: Any) -> Any:
    """`value` with every nan float as None (strict JSON has no NaN: a run whose every sample was lost)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def pooled_markdown(result: dict[str, Any]) -> str:
    level = f"{result['confidence']:.0%}"
    lines = [f"# Pooled over training runs ({result['set']})", ""]
    for group, entry in result["groups"].items():
        lines += [f"## {group}: {len(entry['runs'])} runs", "", f"| metric | mean over runs | {level} interval | "
                  + " | ".join(f"run {i}" for i in range(len(entry["runs"]))) + " |",
                  "|---|---:|---|" + "---:|" * len(entry["runs"])]
        for metric, ci in entry["pooled"].items():
            interval = "-" if ci["low"] is None else f"[{ci['low']:.3f}, {ci['high']:.3f}]"
            values = " | ".join("-" if math.isnan(r["metrics"][metric]) else f"{r['metrics'][metric]:.3f}"
                                for r in entry["runs"])
            mean = "-" if ci["mean"] is None else f"{ci['mean']:.3f}"
            lines.append(f"| {metric} | {mean} | {interval} | {values} |")
        runs = ", ".join(f"{r['eval_dir']} ({r['checkpoint']}, step {r['step']})" for r in entry["runs"])
        lines += ["", f"runs: {runs}", ""]
    if "comparison" in result:
        first, second = result["groups"]
        lines += [f"## {second} - {first} (Welch)", "", f"| metric | difference | {level} interval | p | significant |",
                  "|---|---:|---|---:|---|"]
        parts = [("", result["comparison"])] + [(f" (domain `{d}`)", by_metric)
                                                for d, by_metric in result.get("domain_comparison", {}).items()]
        for label, by_metric in parts:
            for metric, c in by_metric.items():
                interval = "-" if c["low"] is None else f"[{c['low']:+.3f}, {c['high']:+.3f}]"
                p_value = f"{c['p_value']:.3g}" if c["p_value"] is not None else "- (no spread)" if c.get(
                    "no_spread") else "-"
                difference = "-" if c["difference"] is None else f"{c['difference']:+.3f}"
                lines.append(f"| {metric}{label} | {difference} | {interval} | {p_value} | "
                             f"{'yes' if c['significant'] else 'no'} |")
        lines.append("")
    return "\n".join(lines)
