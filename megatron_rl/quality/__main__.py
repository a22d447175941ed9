"""`python -m megatron_rl.quality TASKS.jsonl [options]`: inspect a task set before training.

Per task: solvability (the reference passes), verifier stability (reference and a known-bad
candidate verified `--reruns` times; flaky = a flip rate > 0), exact and near duplicates,
contamination against `--eval-set` files, empty or ambiguous descriptions, and with
`--policy HF_DIR` the policy's pass rate (difficulty bucket; always / never solved
flagged). Up to `--concurrency` tasks are verified at once. A verification the sandbox lost
is replayed (`--attempts` rounds) and never counted as a verdict; a task left without enough
verdicts is flagged `unverified`. Writes to `--out`:

    report.jsonl    one object per task: every measurement and its flags
    summary.md      counts per flag, difficulty histogram, flaky tasks, duplicate pairs, sandbox
                    failures (+ PNGs)
    filtered.jsonl  the tasks without a blocking flag (see BLOCKING)

Exit code 0 even when tasks are flagged (the report is the output); 2 on bad input.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from megatron_rl.quality import checks
from megatron_rl.quality.report import BLOCKING, write_report

logger = logging.getLogger("megatron_rl.quality")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("tasks", type=Path, help="task set: .jsonl / .parquet / saved HF dataset")
    p.add_argument("--out", type=Path, default=None, help="report directory (default: <tasks>.quality/)")
    p.add_argument("--eval-set", type=Path, action="append", default=[], help="evaluation set to check "
                   "contamination against (repeatable)")
    p.add_argument("--reruns", type=int, default=3, help="verifications per candidate (flakiness)")
    p.add_argument("--concurrency", type=int, default=1, help="tasks verified at once (each runs its candidates' "
                   "reruns at once; the sandbox servers queue what exceeds their capacity): raise it when several "
                   "sandbox servers (--sandbox) serve the inspection")
    p.add_argument("--attempts", type=int, default=3, help="rounds of verifications per candidate: the sandbox's "
                   "lost ones (infrastructure failures, not verdicts) are replayed in the rounds after the first")
    p.add_argument("--policy", type=str, default=None, help="HF checkpoint directory whose pass rate sets difficulty")
    p.add_argument("--samples", type=int, default=8, help="policy samples per task")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tokenizer", default="builtin:char")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a tokenizer directory's own code run (as model.trust_remote_code)")
    p.add_argument("--environment", default="repo", help="the environment agent tasks run in (as task.environment)")
    p.add_argument("--runtime", default="bwrap", choices=("bwrap", "apptainer", "process"))
    p.add_argument("--sandbox", action="append", default=[], help="address of a running sandbox server "
                   "(repeatable; default: start a local one)")
    p.add_argument("--ngram", type=int, default=8, help="n of the contamination n-grams")
    p.add_argument("--contamination-threshold", type=float, default=0.5)
    p.add_argument("--near-duplicate-threshold", type=float, default=0.8)
    p.add_argument("--min-words", type=int, default=3, help="descriptions shorter than this are flagged empty")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.reruns < 2:
        p.error("--reruns must be >= 2 to measure flakiness")
    if args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if args.attempts < 1:
        p.error("--attempts must be >= 1 (1: no replay of verifications the sandbox lost)")
    for path in [args.tasks, *args.eval_set]:
        if not path.exists():
            p.error(f"{path} does not exist")
    return args


def load_tasks(path: Path) -> list[dict[str, Any]]:
    from megatron_rl.data.sources import read_splits

    return [row for rows in read_splits(path).values() for row in rows]


def verdicts_in_order(runner: Any, tasks: Sequence[dict[str, Any]], reruns: int,
                      concurrency: int) -> Iterator[Any]:
    """`runner.verdicts(task, reruns)` of each task, in task order, with up to `concurrency` tasks
    verified at once (threads: a task's verifications wait on the sandbox, not on this process).
    A failure is raised when its task's turn comes; tasks not started by then are cancelled."""
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="quality")
    try:
        futures = [pool.submit(runner.verdicts, task, reruns) for task in tasks]
        for future in futures:
            yield future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def inspect(args: argparse.Namespace) -> list[dict[str, Any]]:
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.quality.runner import Runner, policy_engine

    tasks = load_tasks(args.tasks)
    texts = [checks.task_text(t) for t in tasks]
    rows = [{"index": i, "id": t.get("id", str(i)), "flags": []} for i, t in enumerate(tasks)]
    for row, flags in zip(rows, checks.description_flags(tasks, args.min_words)):
        row["flags"] += flags
    for later, first in checks.exact_duplicates(texts).items():
        rows[later]["flags"].append("duplicate")
        rows[later]["duplicate_of"] = rows[first]["id"]
    for i, j, similarity in checks.near_duplicates(texts, args.near_duplicate_threshold):
        if "duplicate" not in rows[j]["flags"]:
            rows[j]["flags"].append("near_duplicate")
            rows[j].update(duplicate_of=rows[i]["id"], similarity=similarity)
    eval_texts = [checks.task_text(t) for path in args.eval_set for t in load_tasks(path)]
    for row, share in zip(rows, checks.contamination(texts, eval_texts, args.ngram) if eval_texts else []):
        row["contamination"] = share
        if share >= args.contamination_threshold:
            row["flags"].append("contaminated")

    tokenizer = load_tokenizer(args.tokenizer, args.trust_remote_code)
    server, addresses = None, list(args.sandbox)
    if not addresses:
        from megatron_rl.rewards.service import start_local_sandbox

        scratch = Path(tempfile.mkdtemp(prefix="quality-"))
        (scratch / "logs").mkdir()
        server, address = start_local_sandbox(scratch, args.runtime, allow_unisolated=args.runtime == "process")
        addresses = [address]
    runner = Runner(addresses, tokenizer, args.environment, attempts=args.attempts)
    engine = policy_engine(args.policy, tokenizer) if args.policy else None
    verdicts_of_tasks, finished = None, False
    try:
        from tqdm import tqdm

        verdicts_of_tasks = verdicts_in_order(runner, tasks, args.reruns, args.concurrency)
        for row, task, verdicts in tqdm(zip(rows, tasks, verdicts_of_tasks), total=len(rows), desc="quality",
                                        unit="task"):
            flip_rate, flags = checks.verdict_flags(verdicts.reference, verdicts.bad)
            row.update(reference_rewards=verdicts.reference, bad_rewards=verdicts.bad, flip_rate=flip_rate,
                       lost=dict(verdicts.lost))
            row["flags"] += flags
            if "unsolvable" in flags:
                row["reference_info"] = verdicts.info
            if engine is not None:
                rewards, num_lost = runner.policy_rewards(task, engine, args.samples, args.max_new_tokens, args.seed)
                row["lost"]["policy"] = num_lost
                row["pass_rate"] = rate = checks.pass_rate(rewards)
                if rate is None:  # every sample lost to the sandbox: no difficulty to report
                    if "unverified" not in row["flags"]:
                        row["flags"].append("unverified")
                else:
                    row["difficulty"] = checks.difficulty_bucket(rate)
                    if row["difficulty"] in ("always", "never"):
                        row["flags"].append(f"{row['difficulty']}_solved")
        finished = True
    finally:
        if verdicts_of_tasks is not None:  # before the runner closes: no verification left running
            verdicts_of_tasks.close()
        runner.close()
        if server is not None:
            from megatron_rl.rewards.service import stop_local_sandbox

            stop_local_sandbox(server)
            if finished:  # the local server's logs are kept only where they can explain a failure
                shutil.rmtree(scratch, ignore_errors=True)
            else:
                logger.error("the local sandbox server's logs are kept in %s", scratch / "logs")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    out = args.out or args.tasks.with_name(args.tasks.name + ".quality")
    rows = inspect(args)
    write_report(rows, load_tasks(args.tasks), out)
    blocked = sum(bool(set(r["flags"]) & BLOCKING) for r in rows)
    unverified = sum("unverified" in r["flags"] for r in rows)
    lost = sum(sum(r.get("lost", {}).values()) for r in rows)
    if lost:
        logger.warning("the sandbox lost %d verifications (replayed where it could); %d tasks unverified: "
                       "see summary.md, rerun when the sandbox is healthy", lost, unverified)
    logger.info("%d tasks, %d blocked, %d kept -> %s", len(rows), blocked, len(rows) - blocked, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
