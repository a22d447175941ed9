"""The outputs of a task-set inspection: a JSONL report (machine-readable), a Markdown
summary with plots (human-readable) and the filtered task set."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.quality.checks import DIFFICULTY_BUCKETS

# Flags that remove a task from filtered.jsonl. always/never_solved are kept: whether to
# train on them depends on the policy; the report shows them. So is `unverified`: the sandbox
# failed, which says nothing against the task; the summary lists those tasks to check again.
BLOCKING = frozenset({"unsolvable", "flaky", "accepts_bad_candidate", "duplicate", "near_duplicate", "contaminated",
                      "empty_description", "ambiguous"})


def write_report(rows: Sequence[dict[str, Any]], tasks: Sequence[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = [t for r, t in zip(rows, tasks) if not set(r["flags"]) & BLOCKING]
    (out / "filtered.jsonl").write_text("".join(json.dumps(t) + "\n" for t in kept))
    plots = _plots(rows, out)
    counts = Counter(flag for r in rows for flag in r["flags"])
    lines = [f"# Task set quality: {len(rows)} tasks, {len(kept)} kept", "",
             "| flag | tasks | blocking |", "|---|---|---|"]
    lines += [f"| {flag} | {n} | {'yes' if flag in BLOCKING else 'no'} |" for flag, n in sorted(counts.items())]
    if not counts:
        lines.append("| (none) | 0 | |")
    flaky = [r for r in rows if "flaky" in r["flags"]]
    if flaky:
        lines += ["", "## Flaky verifiers", "", "| task | flip rate | reference rewards | bad-candidate rewards |",
                  "|---|---|---|---|"]
        lines += [f"| {r['id']} | {r['flip_rate']:.2f} | {r['reference_rewards']} | {r['bad_rewards']} |"
                  for r in flaky]
    lost = [r for r in rows if any(r.get("lost", {}).values())]
    if lost:
        lines += ["", "## Sandbox failures (not verdicts)", "",
                  "Verifications the sandbox lost, replays included; `unverified`: too few came back to judge.", "",
                  "| task | reference | known-bad | policy | unverified |", "|---|---|---|---|---|"]
        lines += [f"| {r['id']} | {r['lost'].get('reference', 0)} | {r['lost'].get('known_bad', 0)} | "
                  f"{r['lost'].get('policy', 0)} | {'yes' if 'unverified' in r['flags'] else 'no'} |" for r in lost]
    pairs = [r for r in rows if r.get("duplicate_of")]
    if pairs:
        lines += ["", "## Duplicates", "", "| task | duplicate of | similarity |", "|---|---|---|"]
        lines += [f"| {r['id']} | {r['duplicate_of']} | {r.get('similarity', 1.0)} |" for r in pairs]
    for name, caption in plots:
        lines += ["", f"## {caption}", "", f"![{caption}]({name})"]
    lines += ["", "Flags per task: report.jsonl. Kept tasks: filtered.jsonl."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def _plots(rows: Sequence[dict[str, Any]], out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    if any("difficulty" in r for r in rows):
        counts = Counter(r["difficulty"] for r in rows if "difficulty" in r)
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(DIFFICULTY_BUCKETS, [counts.get(b, 0) for b in DIFFICULTY_BUCKETS])
        ax.set_ylabel("tasks")
        ax.set_title("pass rate under the policy")
        fig.tight_layout()
        fig.savefig(out / "difficulty.png")
        plt.close(fig)
        made.append(("difficulty.png", "Difficulty"))
    rates = [r["flip_rate"] for r in rows if "flip_rate" in r]
    if rates:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.hist(rates, bins=10, range=(0, 0.5))
        ax.set_xlabel("verifier flip rate")
        ax.set_ylabel("tasks")
        fig.tight_layout()
        fig.savefig(out / "flip_rate.png")
        plt.close(fig)
        made.append(("flip_rate.png", "Verifier stability"))
    return made
