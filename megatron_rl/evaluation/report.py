"""The files an offline evaluation leaves in its output directory, from its records:

    summary.json      per checkpoint and set: each metric's mean over seeds with a t interval,
                      the pooled per-prompt mean with a bootstrap interval over prompts, per seed,
                      and the same per domain
    comparison.json   each checkpoint minus the baseline (the first one), per set and metric (and
    comparison.md     per domain): difference, paired bootstrap interval, sign-flip p-value,
                      significant
    accuracy.png      accuracy against step with the interval as error bars, one line per set
    report.md         all of it as tables, with the plot
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.evaluation.records import compare, summarize
from megatron_rl.evaluation.stats import group_by


def write_report(out: Path, records: Sequence[dict[str, Any]], spec: Any) -> dict[str, Any]:
    """Write the files above for `records` (every checkpoint, set and seed); returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(confidence=spec.confidence, num_resamples=spec.num_resamples)
    by_ckpt = group_by(records, lambda r: r["checkpoint"])
    summary = {"run": str(spec.run), "confidence": spec.confidence, "ks": list(spec.ks), "num_seeds": spec.num_seeds,
               "baseline": spec.checkpoints[0].name, "checkpoints": []}
    for ckpt in spec.checkpoints:
        sets = group_by(by_ckpt.get(ckpt.name, []), lambda r: r["set"])
        summary["checkpoints"].append({"name": ckpt.name, "step": ckpt.step, "kind": ckpt.kind, "path": ckpt.path,
                                       "sets": {s: summarize(rows, spec.ks, **kw) for s, rows in sets.items()}})
    comparisons = []
    base = spec.checkpoints[0]
    for ckpt in spec.checkpoints[1:]:
        for set_name, rows in group_by(by_ckpt.get(ckpt.name, []), lambda r: r["set"]).items():
            base_rows = [r for r in by_ckpt.get(base.name, []) if r["set"] == set_name]
            entry = {"set": set_name, "baseline": base.name, "candidate": ckpt.name, "baseline_step": base.step,
                     "candidate_step": ckpt.step, "metrics": compare(base_rows, rows, spec.ks, **kw)}
            domains = group_by(rows, lambda r: r.get("domain", ""))
            if len(domains) > 1:  # each domain's prompts paired on their own
                base_domains = group_by(base_rows, lambda r: r.get("domain", ""))
                entry["domains"] = {d: compare(base_domains.get(d, []), d_rows, spec.ks, **kw)
                                    for d, d_rows in sorted(domains.items())}
            comparisons.append(entry)
    comparison = {"baseline": base.name, "confidence": spec.confidence, "comparisons": comparisons}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
    (out / "comparison.md").write_text(comparison_markdown(comparison) + "\n")
    plot = plot_accuracy(summary, out / "accuracy.png")
    (out / "report.md").write_text(report_markdown(summary, comparison, plot) + "\n")
    return summary


def _mean(d: dict[str, Any]) -> str:
    return "n/a" if d["mean"] is None else f"{d['mean']:.3f}"  # None: every sample lost


def _ci(d: dict[str, Any]) -> str:
    if d["low"] is None:
        return "n/a"
    return f"[{d['low']:.3f}, {d['high']:.3f}]"


def comparison_markdown(comparison: dict[str, Any]) -> str:
    conf = round(100 * comparison["confidence"])
    lines = [f"Each checkpoint minus the baseline `{comparison['baseline']}`, paired by prompt: difference, "
             f"{conf}% paired-bootstrap interval, two-sided sign-flip p-value; significant when p < "
             f"{1 - comparison['confidence']:.2f}.", "",
             "| set | candidate | metric | difference | interval | p-value | significant |",
             "|---|---|---|---|---|---|---|"]
    for c in comparison["comparisons"]:
        parts = [(c["set"], c["metrics"])] + [(f"{c['set']}, domain `{d}`", m) for d, m in c.get("domains", {}).items()]
        for label, metrics in parts:
            for name, m in metrics.items():
                lines.append(f"| {label} | {c['candidate']} | {name} | {m['difference']:+.3f} | "
                             f"[{m['low']:+.3f}, {m['high']:+.3f}] | {m['p_value']:.3g} | "
                             f"{'yes' if m['significant'] else 'no'} |")
    if not comparison["comparisons"]:
        lines.append("| (one checkpoint: nothing to compare) | | | | | | |")
    return "\n".join(lines)


def _metric_table(summary: dict[str, Any], set_name: str, domain: str | None = None) -> list[str]:
    names = ["accuracy", *(f"pass@{k}" for k in summary["ks"])]
    header = "| checkpoint | step | " + " | ".join(f"{n} (seeds) | {n} (prompts)" for n in names) + " |"
    lines = [header, "|" + "---|" * (2 + 2 * len(names))]
    for ckpt in summary["checkpoints"]:
        s = ckpt["sets"].get(set_name)
        if s is None or (domain is not None and domain not in s.get("domains", {})):
            continue
        s = s if domain is None else s["domains"][domain]
        cells = []
        for n in names:
            m = s["metrics"][n]
            cells += [f"{_mean(m['seeds'])} {_ci(m['seeds'])}", f"{_mean(m['prompts'])} {_ci(m['prompts'])}"]
        lines.append(f"| {ckpt['name']} | {'' if ckpt['step'] is None else ckpt['step']} | " + " | ".join(cells) + " |")
    return lines


def _episode_table(summary: dict[str, Any], set_name: str) -> list[str]:
    """Agent episodes per checkpoint: model turns (mean; of the solved ones) and how they ended."""
    endings = sorted({e for c in summary["checkpoints"] for e in c["sets"].get(set_name, {}).get("episodes", {})
                      .get("ended", {})})
    lines = ["| checkpoint | turns (mean) | turns, solved episodes | " + " | ".join(endings) + " |",
             "|---|---|---|" + "---|" * len(endings)]
    for ckpt in summary["checkpoints"]:
        e = ckpt["sets"].get(set_name, {}).get("episodes")
        if e is None:
            continue
        solved = "n/a" if e["turns_mean_solved"] is None else f"{e['turns_mean_solved']:.2f}"
        shares = " | ".join(f"{e['ended'].get(name, 0.0):.0%}" for name in endings)
        lines.append(f"| {ckpt['name']} | {e['turns_mean']:.2f} | {solved} | {shares} |")
    return lines


def report_markdown(summary: dict[str, Any], comparison: dict[str, Any], plot: Path | None) -> str:
    conf = round(100 * summary["confidence"])
    lines = [f"# Evaluation of {summary['run']}", "",
             f"{len(summary['checkpoints'])} checkpoints, {summary['num_seeds']} seeds each. \"seeds\": mean over "
             f"seeds with a {conf}% Student-t interval (sampling noise); \"prompts\": all samples of a prompt "
             f"pooled, mean over prompts with a {conf}% bootstrap interval over prompts (prompt-set noise). "
             "pass@k is the unbiased estimator (Chen et al. 2021). See docs/evaluation.md.", ""]
    set_names = list(dict.fromkeys(s for c in summary["checkpoints"] for s in c["sets"]))
    for set_name in set_names:
        first = next(c["sets"][set_name] for c in summary["checkpoints"] if set_name in c["sets"])
        lines += [f"## Set `{set_name}` ({first['num_prompts']} prompts, {first['num_samples']} samples per "
                  "checkpoint)", "", *_metric_table(summary, set_name), ""]
        if "episodes" in first:
            lines += [*_episode_table(summary, set_name), ""]
        for domain in first.get("domains", {}):
            lines += [f"### Domain `{domain}`", "", *_metric_table(summary, set_name, domain), ""]
    lines += ["## Comparison with the baseline", "", comparison_markdown(comparison), ""]
    if plot is not None:
        lines += ["## Accuracy by step", "", f"![accuracy by step]({plot.name})", ""]
    return "\n".join(lines)


def plot_accuracy(summary: dict[str, Any], path: Path) -> Path | None:
    """Accuracy against step (checkpoint index for checkpoints without a step), error bars from
    the seeds' t interval, or the prompt bootstrap with one seed; None if nothing to plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    drawn = False
    set_names = list(dict.fromkeys(s for c in summary["checkpoints"] for s in c["sets"]))
    for set_name in set_names:
        xs, ys, lows, highs = [], [], [], []
        for index, ckpt in enumerate(summary["checkpoints"]):
            if set_name not in ckpt["sets"]:
                continue
            m = ckpt["sets"][set_name]["metrics"]["accuracy"]
            ci = m["seeds"] if m["seeds"]["low"] is not None else m["prompts"]
            if m["seeds"]["mean"] is None or ci["low"] is None:  # every sample lost: no point to draw
                continue
            xs.append(index if ckpt["step"] is None else ckpt["step"])
            ys.append(m["seeds"]["mean"])
            lows.append(max(0.0, ys[-1] - max(ci["low"], 0.0)))  # shown within [0, 1], where accuracy lives
            highs.append(max(0.0, min(ci["high"], 1.0) - ys[-1]))
        if xs and all(math.isfinite(y) for y in ys):
            axes.errorbar(xs, ys, yerr=[lows, highs], marker="o", capsize=4, label=set_name)
            drawn = True
    if not drawn:
        return None
    axes.set_xlabel("step")
    axes.set_ylabel("accuracy (mean reward)")
    axes.set_ylim(-0.02, 1.02)
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_title(f"accuracy, {round(100 * summary['confidence'])}% intervals")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    return path
