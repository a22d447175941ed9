"""Offline evaluation of a run's checkpoints:

    python -m megatron_rl.eval --run RUN_DIR [--checkpoints all|latest|best|hf|STEP|DIR ...] [--seeds 3]
        [--pass-k 1 4] [--regression [SET=]FILE.jsonl | [SET=]task=NAME,...]... [--name NAME | --out DIR]
        [key=value ...]

and of repeated training runs, from their evaluations (no model is loaded):

    python -m megatron_rl.eval --pool EVAL_DIR ... [--against EVAL_DIR ...] [--step STEP]
        [--set heldout] [--pass-k 1 4] [--out DIR]

The run's config.yaml gives model, task, rollout and layout; `key=value` overrides change them
for the evaluation (samples per prompt: task.eval_samples=8; held-out prompts: task.num_eval=500;
rollout.temperature=0.7; cluster.nproc=2). Output goes to RUN_DIR/eval/NAME/ (records.jsonl,
summary.json, comparison.json/.md, report.md, accuracy.png). `--pool` takes the output
directories of such evaluations, one per run (runs trained alike with different seeds), and
writes the mean over runs with its interval (and, with `--against`, the Welch comparison of the
two groups) to DIR (default ./pooled): pooled.json, pooled.md. Logic in megatron_rl/evaluation/;
see docs/evaluation.md. A damaged training checkpoint (a file missing, truncated or changed since the
save: checked against its manifest) is refused, naming the file (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from megatron_rl import runtime


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.eval", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--run", help="run directory written by `python -m megatron_rl.train`")
    parser.add_argument("--pool", nargs="+", metavar="EVAL_DIR",
                        help="evaluation directories (RUN/eval/NAME) of repeated runs: one interval over runs")
    parser.add_argument("--against", nargs="+", metavar="EVAL_DIR",
                        help="with --pool: a second group of runs, compared with the first (second - first)")
    parser.add_argument("--step", type=int, default=None,
                        help="with --pool: the training step to take from each run (default: its latest evaluated)")
    parser.add_argument("--set", default="heldout", dest="set_name",
                        help="with --pool: heldout (default), regression or a regression set's name")
    parser.add_argument("--checkpoints", nargs="+", default=["all"], metavar="CKPT",
                        help="all (default: every training checkpoint, by step), latest, best, hf (every HF export), a "
                             "step number, a checkpoint name or directory; the first one is the baseline")
    parser.add_argument("--seeds", type=int, default=3, help="sampling seeds per checkpoint (default 3)")
    parser.add_argument("--pass-k", type=int, nargs="+", default=None, metavar="K",
                        help="k values of pass@k, each <= task.eval_samples (default: 1 and task.eval_samples)")
    parser.add_argument("--regression", action="append", default=[], metavar="[SET=]FILE|task=NAME,...",
                        help="regression set evaluated on every checkpoint besides the held-out set: a file "
                             "(JSONL / Parquet / saved dataset, the run's task columns) or a task config, "
                             "task=NAME[,key=value...] (the eval split of conf/task/NAME.yaml with those task "
                             "fields, e.g. task=arithmetic,num_eval=200,seed=7 or task=arithmetic,type=agent,generator=function). "
                             "Repeat it for several sets, each named SET= or after its task / file "
                             "(one set without a name: 'regression')")
    parser.add_argument("--name", default=None, help="output under RUN/eval/NAME (default: a timestamp)")
    parser.add_argument("--out", default=None, help="output directory (instead of RUN/eval/NAME)")
    parser.add_argument("--confidence", type=float, default=0.95, help="interval level (default 0.95)")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap / permutation resamples")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of the run's config")
    return parser.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> None:
    from megatron_rl.checkpoint.integrity import refuse_damaged
    from megatron_rl.config import ConfigError
    from megatron_rl.evaluation.runner import (
        EvalSpec,
        load_run_config,
        regression_sets,
        resolve_checkpoints,
    )
    from megatron_rl.rl.evaluate import evaluate_checkpoints

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if (args.run is None) == (args.pool is None):
        print("config error: give either --run RUN_DIR (evaluate a run's checkpoints) or --pool EVAL_DIR ... "
              "(pool evaluations of repeated runs)", file=sys.stderr)
        raise SystemExit(2)
    if args.pool:
        return pool_main(args)
    if args.against or args.step is not None:
        print("config error: --against and --step go with --pool", file=sys.stderr)
        raise SystemExit(2)
    out = Path(args.out or Path(args.run) / "eval" / (args.name or time.strftime("%Y%m%d-%H%M%S"))).resolve()
    try:
        if args.seeds < 1:
            raise ConfigError(f"--seeds={args.seeds} is invalid: must be >= 1 (3 or more give intervals)")
        cfg = load_run_config(args.run, out, args.overrides)
        n = cfg.task.eval_samples
        ks = tuple(dict.fromkeys(args.pass_k or [1, n]))
        if any(not 1 <= k <= n for k in ks):
            raise ConfigError(f"--pass-k {' '.join(map(str, ks))} is invalid with task.eval_samples={n}: each k "
                              f"must be in 1..{n}; draw more samples with task.eval_samples=N")
        checkpoints = resolve_checkpoints(args.run, args.checkpoints)
        for ckpt in checkpoints:  # names and sizes against the manifest; the digests when the ranks load it
            if ckpt.kind == "train":
                refuse_damaged(Path(ckpt.path), checksums=False)
        regression = regression_sets(args.regression)
    except ValueError as exc:  # ConfigError is one
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    spec = EvalSpec(run=str(Path(args.run).resolve()), checkpoints=checkpoints, out_dir=cfg.run_dir,
                    num_seeds=args.seeds, ks=ks, regression=regression, confidence=args.confidence,
                    num_resamples=args.resamples)
    rt = runtime.start_with_config(cfg, argv, "megatron_rl.eval")
    if rt is None:  # this process launched the local workers, which did the work
        return
    try:
        evaluate_checkpoints(rt, spec)
    finally:
        runtime.finish(rt)


def pool_main(args: argparse.Namespace) -> None:
    """`--pool`: read the evaluations, pool per group, write pooled.json / pooled.md, print the table."""
    import json

    from megatron_rl.evaluation.pooling import json_safe, pool_runs, pooled_markdown

    groups = {"pool": args.pool, **({"against": args.against} if args.against else {})}
    given = [d for dirs in groups.values() for d in dirs]
    try:
        if args.overrides or args.regression or args.name or any("=" in d and not Path(d).exists() for d in given):
            raise ValueError("--pool reads finished evaluations: it takes no key=value overrides, --regression or "
                             "--name (use --out DIR)")
        result = pool_runs(groups, args.pass_k, args.step, args.set_name, args.confidence)
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    out = Path(args.out or "pooled")
    out.mkdir(parents=True, exist_ok=True)
    (out / "pooled.json").write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
    text = pooled_markdown(result)
    (out / "pooled.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
