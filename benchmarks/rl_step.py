"""End-to-end RL step breakdown: where a step's time goes (per phase), and how long the
device does neither generation nor training, for the colocated loop and the disaggregated
one on the same task and settings, side by side in the same run, as ratios.

    python benchmarks/rl_step.py [--steps 8] [--new-tokens 64] [overrides ...]

Each mode is the main job (`python -m megatron_rl.train mode=rl ...`) in a subprocess; the
figures come from what every run writes: `metrics.jsonl` (the colocation controller times
each phase: offload, weight sync, generate, release, onload; the step times training) and, in
disaggregated mode, the process timelines `timeline/*.jsonl` (the trainer waiting for groups,
training, publishing; the generators generating). The first step (start-up) and the last one
(it runs the final evaluation) are left out: steps 2 to N-1, numbered as in metrics.jsonl.

Both sides get the same cores (`--cores`, default 2): the disaggregated run is a trainer process and a
generator process of one thread each; the colocated baseline is the faster of one process with that many
threads and that many data-parallel ranks of one thread (`cluster.nproc`), both printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("offload_trainer", "resume_engine_weights", "sync_weights", "resume_engine_kv", "generate",
          "release_engine", "onload_trainer", "train")


def _run(run_dir: Path, common: list[str], *extra: str, threads: int = 1) -> list[dict]:
    args = [sys.executable, "-m", "megatron_rl.train", *common, f"run_dir={run_dir}", *extra]
    proc = subprocess.run(args, env=dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO)),
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]  # row 0: the evaluation before any update
    return trained[1:-1]


def _mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / len(rows)


def _union(spans: list[tuple[float, float]]) -> float:
    total, cursor = 0.0, float("-inf")
    for start, end in sorted(spans):
        start = max(start, cursor)
        if end > start:
            total += end - start
            cursor = end
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="RL steps per run (>= 3)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--staleness", type=int, default=1, help="algorithm.max_staleness of the disaggregated run")
    p.add_argument("--cores", type=int, default=2, help="cores each mode gets (the disaggregated run: trainer "
                   "+ 1 generator, so --cores 2)")
    p.add_argument("overrides", nargs="*", help="more overrides for both runs")
    args = p.parse_args()
    if args.steps < 3:
        p.error("--steps must be >= 3 (the first and the last step are left out)")
    common = ["+experiment=demo_countdown", "task=arithmetic", "task.sft_warmup_steps=10", "global_batch_size=32",
              "rollout.n_samples_per_prompt=4", "task.num_eval=8", "task.eval_samples=1", "task.eval_every=0",
              f"rollout.max_new_tokens={args.new_tokens}", f"num_steps={args.steps}", "checkpoint.save_every=0",
              "checkpoint.save_at_end=false", "logging.progress=false", *args.overrides]
    if args.cores != 2:
        p.error("--cores 2 only: the disaggregated run is one trainer and one generator process of one thread")
    with tempfile.TemporaryDirectory() as tmp:
        threaded = _run(Path(tmp) / "threads", common, threads=args.cores)
        ranks = _run(Path(tmp) / "ranks", common, f"cluster.nproc={args.cores}")
        disagg_dir = Path(tmp) / "disaggregated"
        disagg = _run(disagg_dir, common, "rollout.mode=disaggregated", f"algorithm.max_staleness={args.staleness}",
                      "rollout.num_generators=1")
        events = {path.stem: [json.loads(line) for line in path.read_text().splitlines()]
                  for path in (disagg_dir / "timeline").glob("*.jsonl")}

    print(f"settings: {' '.join(common)}")
    options = {f"1 process x {args.cores} threads": threaded, f"{args.cores} ranks x 1 thread": ranks}
    for name, rows in options.items():
        print(f"colocated, {name}: {_mean(rows, 'time/step'):.3f} s/step")
    best = min(options, key=lambda name: _mean(options[name], "time/step"))
    colocated = options[best]
    step = _mean(colocated, "time/step")
    print(f"\ncolocated baseline ({best}, the faster), mean of steps 2-{args.steps - 1}: {step:.3f} s/step")
    accounted = 0.0
    for phase in PHASES:
        seconds = _mean(colocated, f"time/{phase}")
        accounted += seconds
        print(f"  {phase:30s} {seconds:8.3f} s  {seconds / step:6.1%}")
        if phase == "generate":
            for part in ("generate_only", "reward_wait"):
                value = _mean(colocated, f"time/{part}")
                print(f"    {part:28s} {value:8.3f} s  {value / step:6.1%}")
    print(f"  {'other (advantages, logging)':30s} {step - accounted:8.3f} s  {(step - accounted) / step:6.1%}")
    busy = _mean(colocated, "time/generate_only") + _mean(colocated, "time/train")
    print(f"  device idle (neither generating nor training): {step - busy:.3f} s/step, {(step - busy) / step:.1%}")

    d_step = _mean(disagg, "time/step")
    trainer = events.get("trainer", [])
    takes = {e["step"]: e for e in trainer if e["event"] == "take"}
    # the timeline counts the steps done before: steps 2 .. steps-1, as above
    first, last = takes[1]["start"], takes[args.steps - 1]["start"]
    window = [e for e in trainer if first <= e["start"] < last]
    span = last - first

    def per_step(name: str) -> float:
        return sum(e["end"] - e["start"] for e in window if e["event"] == name) / (args.steps - 2)

    print(f"\ndisaggregated (max_staleness={args.staleness}), mean of steps 2-{args.steps - 1}: {d_step:.3f} s/step")
    print(f"  trainer: waiting for groups {per_step('take'):.3f} s, training {per_step('train'):.3f} s, "
          f"publishing weights {per_step('publish'):.3f} s per step")
    for name, log in sorted(events.items()):
        if name.startswith("generator") and span > 0:
            spans = [(max(e["start"], first), min(e["end"], last)) for e in log if e["event"] == "generate"]
            print(f"  {name}: generating {_union(spans) / span:.1%} of the trainer's steps 2-{args.steps - 1}")
    print(f"\nstep time disaggregated / colocated ({args.cores} cores each): x{d_step / step:.2f}")


if __name__ == "__main__":
    main()
