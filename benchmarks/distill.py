"""On-policy distillation's estimators side by side, on the run tests/integration/test_distill_loop.py makes: the tiny
student (tiny_qwen2, random init) distils from a 2-layer Llama teacher whose output layer is scaled x30, with the
same 128-token character tokenizer, `algorithm.distill.mode=pure`, for --steps steps, once per arm:

    sampled    algorithm.distill.estimator=sampled (the baseline: the teacher's log-prob of each sampled token)
    topk16     estimator=topk, topk=16 (the KL over the teacher's 16 likeliest tokens and a bucket for the rest)
    topk128    estimator=topk, topk=128 (the whole vocabulary: the exact per-position KL)

    .venv/bin/python benchmarks/distill.py [--steps 40] [--plot docs/img/distill_tiny_estimators.png]
    .venv/bin/python benchmarks/distill.py --compare RUN_DIR [RUN_DIR ...] [--window 10] [--plot FILE] [--title T]

--compare runs nothing: it tabulates (and plots) the same measures from finished runs' metrics.jsonl, the first
directory the baseline (docs/rl.md compares the SmolLM2 example's two estimators so).

Every arm logs the same measure, `distill/reverse_kl` (the sampled-token estimate of the student's reverse KL to the
teacher at the tokens it sampled, whatever the arm trains on), so the arms compare on it: its mean over the first
and last 5 steps and their ratio, and the median step time with its ratio to the baseline's. The arms run one after
another in subprocesses with one thread each (OMP_NUM_THREADS=1), as the test does. Prints a table and a RESULT
line; --plot draws the three curves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ARMS = {"sampled": ["algorithm.distill.estimator=sampled"],
        "topk16": ["algorithm.distill.estimator=topk", "algorithm.distill.topk=16"],
        "topk128": ["algorithm.distill.estimator=topk", "algorithm.distill.topk=128"]}


def run_arm(name: str, teacher: Path, work: Path, steps: int) -> list[dict]:
    from tests.integration.test_distill_loop import run_distill

    try:
        return run_distill(teacher, work / name, steps, tuple(ARMS[name]))
    except RuntimeError as exc:
        sys.exit(f"[distill] arm {name}: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--plot", type=Path, default=None, help="write the reverse-KL curves to this PNG")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--compare", type=Path, nargs="+", default=None,
                        help="finished run directories to tabulate instead of running the tiny arms")
    parser.add_argument("--window", type=int, default=5, help="steps averaged at the start and at the end")
    parser.add_argument("--title", default=None, help="the plot's title")
    args = parser.parse_args()
    if args.compare:
        from tests.integration.test_distill_loop import distill_rows

        found = {str(path): distill_rows(path) for path in args.compare}
        title = "the runs compared"
    else:
        from tests.unit.test_distill import save_teacher

        work = args.work or Path(tempfile.mkdtemp(prefix="distill_bench_"))
        work.mkdir(parents=True, exist_ok=True)
        teacher = work / "teacher"
        if not (teacher / "config.json").is_file():
            save_teacher(teacher, sharpen=30.0)
        found = {name: run_arm(name, teacher, work, args.steps) for name in ARMS}
        title = "tiny student, sharpened tiny teacher: the three estimators"
    names = list(found)
    base_time = statistics.median(r["time/step"] for r in found[names[0]])
    n = args.window
    width = max(9, *map(len, names))
    print(f"{'arm':<{width}} {f'KL first {n}':>10} {f'KL last {n}':>10} {'last/first':>10} {'step s':>8} "
          f"{'vs first':>8}")
    summary = {}
    for name, rows in found.items():
        kl = [r["distill/reverse_kl"] for r in rows]
        first, last = statistics.mean(kl[:n]), statistics.mean(kl[-n:])
        step = statistics.median(r["time/step"] for r in rows)
        summary[name] = dict(steps=len(rows), first=first, last=last, fall=last / first, step=step,
                             time_ratio=step / base_time)
        print(f"{name:<{width}} {first:>10.3f} {last:>10.3f} {last / first:>10.3f} {step:>8.3f} "
              f"{step / base_time:>8.2f}")
    print("RESULT " + json.dumps({"baseline": names[0], **summary}))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, rows in found.items():
            ax.plot([r["step"] for r in rows], [r["distill/reverse_kl"] for r in rows], label=Path(name).name)
        ax.set_xlabel("step")
        ax.set_ylabel("distill/reverse_kl (nats per token)")
        ax.set_title(args.title or title)
        ax.legend()
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
