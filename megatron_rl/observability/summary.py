"""The line an RL run ends with, from its metrics.jsonl rows: how the training reward and the held-out
accuracy moved, each number saying which steps it is about (a row's `step` is the updates done when
it was written; docs/rl.md, "Metrics")."""

from __future__ import annotations

from typing import Mapping, Sequence


def _steps(rows: Sequence[Mapping[str, float]]) -> str:
    first, last = int(rows[0]["step"]), int(rows[-1]["step"])
    return f"step {first}" if len(rows) == 1 else f"steps {first}-{last}"


def rl_summary(rows: Sequence[Mapping[str, float]], warm_start_steps: int) -> str:
    """E.g. "training reward 0.120 over steps 1-2 -> 0.340 over steps 19-20 (x2.83); held-out accuracy 0.100 at
    step 0 (after a 30-step warm start) -> 0.250 at step 20". The reward is the mean over the first and the
    last tenth of the training steps (at least one step each); the accuracy that of the first and the last
    evaluation; `warm_start_steps`: the supervised steps before RL (task.sft_warmup_steps), named only when
    there were some; then the samples no verifier judged over the run, when there were any. "" for rows with
    neither reward nor accuracy."""
    trained = [r for r in rows if "reward/mean" in r]
    evaluated = [r for r in rows if "eval/accuracy" in r]
    out = []
    if trained:
        k = max(1, len(trained) // 10)
        head, tail = trained[:k], trained[-k:]
        first, last = (sum(r["reward/mean"] for r in part) / k for part in (head, tail))
        ratio = f" (x{last / first:.2f})" if first > 0 else ""  # no ratio from a zero start
        out.append(f"training reward {first:.3f} over {_steps(head)} -> {last:.3f} over {_steps(tail)}{ratio}")
    if evaluated:
        start, end = evaluated[0], evaluated[-1]
        origin = f" (after a {warm_start_steps}-step warm start)" if warm_start_steps and start["step"] == 0 else ""
        line = f"held-out accuracy {start['eval/accuracy']:.3f} at step {int(start['step'])}{origin}"
        if end is not start:
            line += f" -> {end['eval/accuracy']:.3f} at step {int(end['step'])}"
        out.append(line)
    unscored = sum(r.get("reward/unscored", 0.0) for r in trained)
    if unscored:  # samples no verifier judged (timeouts, errors, no sandbox server): left out of the loss
        errors = sum(r.get("reward/verifier_errors", 0.0) for r in trained)
        out.append(f"{unscored:.0f} samples left unscored, no verdict ({errors:.0f} verifier errors; "
                   "reward/unscored per step)")
    return "; ".join(out)
