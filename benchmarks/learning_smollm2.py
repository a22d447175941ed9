"""Learning benchmark on a real model: the SmolLM2 recipe (`conf/experiment/smollm2_math.yaml`) over
several seeds, and TRL's `GRPOTrainer` on the same model, prompts, sample budget and cores, side by side.

    .venv/bin/python benchmarks/learning_smollm2.py --model $(bash launch/get_model.sh smollm2-135m) \
        --seeds 0 1 2 --trl-seeds 0 --work-dir WORK [--slots 2] [--steps 30]

Needs `trl` (`.venv/bin/pip install trl`), as benchmarks/learning.py does. Nothing is downloaded.

Jobs, each a subprocess:
1. Ours, one per seed: `python -m megatron_rl.train +experiment=smollm2_math model.path=MODEL seed=S`.
2. TRL, one per TRL seed: `GRPOTrainer` in a subprocess (`--worker trl`). Every setting is read from the
   recipe's own composed config (the same overrides): the training prompts are the task's own
   (`data.tasks.Task(...).prompts("train")`, chat template applied, as strings, so TRL applies no template
   of its own), the reward is the task's strict reading (`rewards.rule.math_reward`), and temperature,
   top-p/k, max_completion_length, num_generations, prompts per step, lr (constant), Adam betas/eps, grad
   clip, epsilon, num_iterations = inner updates, beta = kl_coef (0), loss_type "dapo" (= token mean over
   the batch, ours' `loss_agg_mode: token_mean`), group-scaled rewards, fp32, CPU. It saves the model as HF
   at every multiple of the recipe's `checkpoint.save_every`, so both are compared at equal budgets.
3. Evaluation, by the project's offline evaluator for every model alike (`python -m megatron_rl.eval
   --run OURS --checkpoints DIR|latest --seeds 1`, greedy): the held-out set and 100 two-step problems
   (never trained on), read strictly and, in a second evaluation, by the last number
   (`task.answer_extraction=last_number`). The checkpoint itself is evaluated once.
4. Pooling: `python -m megatron_rl.eval --pool` over ours' seeds (a Student-t interval over runs), and
   over TRL's seeds when there are several.

With `--slots 2` (the default where there are 2 or more CPUs) two jobs run at a time, each pinned to its
own CPU (`taskset`) with one thread; ours and TRL of the same seed start together, so each sees one core
and the same load beside it. Wall times per step are therefore single-core figures. With `--slots 1` each
job runs alone with every thread. A job whose output is complete in WORK is not run again, so the driver
can be restarted; a training run that was killed resumes from its last checkpoint.

Prints one table: held-out accuracy (strict, by the last number), answers cut at the length limit, two-step
problems, training reward over the first and last 10% of steps, median wall time per step and tokens
generated per step, for the checkpoint, ours (pooled over seeds) and TRL.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learning import _check_trl, _edge_means  # noqa: E402  (the tiny model's learning benchmark)

RECIPE = "+experiment=smollm2_math"
TWO_STEP = "two_step=task=arithmetic,math_steps=2,num_eval={n}"


def recipe_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    """The recipe's overrides for one seed, as ours runs them and TRL reads them."""
    return [RECIPE, f"model.path={args.model}", f"seed={seed}", f"num_steps={args.steps}", *args.set]


# ---------------------------------------------------------------------------------------------
# TRL worker
# ---------------------------------------------------------------------------------------------

def run_trl_worker(args: argparse.Namespace) -> None:
    version = _check_trl()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rl.config.loader import load_config
    from megatron_rl.data.tasks import Task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rewards.rule import extract_answer, math_reward

    cfg = load_config(recipe_overrides(args, args.seed), world_size=1)
    out = Path(args.out)
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code)
    task = Task(cfg.task, tokenizer)
    if task.cfg.type != "arithmetic":
        sys.exit(f"the TRL worker runs the math recipe; task.type is {task.cfg.type!r}")
    lenient = cfg.task.answer_extraction == "last_number"
    prompts = task.prompts("train")
    dataset = Dataset.from_list([{"prompt": p.text, "answer": p.meta["answer"]} for p in prompts])
    rewards: list[float] = []
    unformatted: list[float] = []
    tokens: list[int] = []

    def math_task_reward(prompts, completions, answer, completion_ids=None, **_):
        scores = [math_reward(c, a, last_number=lenient) for c, a in zip(completions, answer)]
        rewards.append(sum(scores) / len(scores))
        unformatted.append(sum(extract_answer(c)[0] is None for c in completions) / len(completions))
        if completion_ids is not None:
            tokens.append(sum(len(ids) for ids in completion_ids))
        return scores

    inner = cfg.algorithm.num_inner_updates
    save_every = cfg.checkpoint.save_every or args.steps
    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(time.perf_counter())

        def on_step_end(self, _args, state, _control, model=None, **__):
            if state.global_step % inner:
                return  # one RL step = `inner` optimizer steps on one generation batch
            ends.append(time.perf_counter())
            step = state.global_step // inner
            if step % save_every == 0 or step == args.steps:
                model.save_pretrained(out / f"step_{step}")
                tokenizer.save_pretrained(out / f"step_{step}")
                (out / "progress.json").write_text(json.dumps({"steps": step, "rewards": rewards,
                                                               "step_times": [b - a for a, b in zip(ends, ends[1:])]}))

    # One generation batch of global_batch_size completions per optimizer step, as ours; the update runs over
    # micro-batches of `micro` completions with gradient accumulation (the whole batch's full-vocabulary logits
    # at once take over 20 GB), and loss_type "dapo" normalises by the tokens of the whole generation batch.
    micro = args.trl_micro_batch
    if cfg.global_batch_size % micro:
        sys.exit(f"--trl-micro-batch {micro} must divide global_batch_size {cfg.global_batch_size}")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, fp16=False, seed=cfg.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=cfg.global_batch_size // micro,
        num_generations=cfg.rollout.n_samples_per_prompt, max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k if cfg.rollout.top_k > 0 else 0,
        learning_rate=cfg.optimizer.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.optimizer.weight_decay, adam_beta1=cfg.optimizer.adam_beta1,
        adam_beta2=cfg.optimizer.adam_beta2, adam_epsilon=cfg.optimizer.adam_eps,
        max_grad_norm=cfg.optimizer.clip_grad, gradient_checkpointing=False,
        num_iterations=inner, epsilon=cfg.algorithm.eps_clip, beta=cfg.algorithm.kl_coef, loss_type="dapo",
        scale_rewards="group", max_steps=args.steps * inner, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, log_completions=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[math_task_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    (out / "result.json").write_text(json.dumps({
        "trl_version": version, "rewards": rewards, "unformatted": unformatted, "completion_tokens": tokens,
        "step_times": [b - a for a, b in zip(ends, ends[1:])], "train_wall_s": wall,
        "threads": torch.get_num_threads(), "prompts": len(prompts)}, indent=1))
    print(f"TRL {version}: {args.steps} RL steps in {wall:.0f}s; reward {rewards[0]:.3f} -> {rewards[-1]:.3f}",
          flush=True)


# ---------------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------------

@dataclass
class Job:
    name: str
    cmd: list[str]
    done: Path  # exists once the job's output is complete
    deps: list[str] = field(default_factory=list)
    # whether a job that exited 0 did all its work: a training run stopped by a signal exits 0 after its
    # checkpoint (megatron_rl.preemption), and must not be taken for a finished one
    complete: Callable[[], bool] = lambda: True
    proc: Optional[subprocess.Popen] = None
    cpu: Optional[int] = None
    start: float = 0.0


def run_jobs(jobs: list[Job], work: Path, slots: int) -> None:
    """Run `jobs` in order, `slots` at a time (each pinned to its own CPU with one thread when slots > 1),
    a job only once the jobs it depends on are done. Exits with the log's tail when one fails."""
    finished = {j.name for j in jobs if j.done.exists()}
    for name in sorted(finished):
        print(f"[{name}] already done ({next(j.done for j in jobs if j.name == name)})", flush=True)
    pending = [j for j in jobs if j.name not in finished]
    running: list[Job] = []
    free = list(range(slots))
    while pending or running:
        for job in [j for j in pending if all(d in finished for d in j.deps)]:
            if not free:
                break
            pending.remove(job)
            job.cpu = free.pop(0)
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            cmd = job.cmd
            if slots > 1:
                env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
                cmd = ["taskset", "-c", str(job.cpu)] + cmd
            log = work / f"{job.name}.log"
            print(f"[{job.name}] {'cpu ' + str(job.cpu) + ': ' if slots > 1 else ''}{' '.join(job.cmd)}\n"
                  f"[{job.name}] log: {log}", flush=True)
            job.start = time.perf_counter()
            job.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)
            running.append(job)
        time.sleep(2)
        for job in list(running):
            rc = job.proc.poll()
            if rc is None:
                continue
            running.remove(job)
            free.append(job.cpu)
            log = work / f"{job.name}.log"
            if rc != 0:
                for other in running:  # a training run checkpoints on SIGTERM and stops: wait for it
                    other.proc.terminate()
                    other.proc.wait()
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
                sys.exit(f"[{job.name}] failed with exit code {rc}; last lines of {log}:\n{tail}")
            wall = time.perf_counter() - job.start
            if not job.complete():
                for other in running:
                    other.proc.terminate()
                    other.proc.wait()
                sys.exit(f"[{job.name}] stopped before its last step (a stop signal: it checkpointed); run the same "
                         f"command to resume it")
            if job.done.suffix == ".done":  # a training job; an evaluation's marker is its own summary.json
                job.done.write_text(json.dumps({"wall_s": wall, "slots": slots}))
            finished.add(job.name)
            print(f"[{job.name}] done in {wall:.0f}s", flush=True)
        if pending and not running and not any(all(d in finished for d in j.deps) for j in pending):
            sys.exit(f"jobs waiting on jobs that will not run: {[j.name for j in pending]}")


def _trained_to(run: Path, steps: int) -> bool:
    """Whether the run's metrics.jsonl holds its last step's row (a resumed run's rows after its checkpoint are
    written again, so the file never holds a step twice)."""
    from megatron_rl.observability import read_metrics

    path = run / "metrics.jsonl"
    return path.exists() and any(r.get("step") == steps and "reward/mean" in r for r in read_metrics(path))


def eval_jobs(name: str, run: Path, ckpt: str, out: Path, deps: list[str], two_step: int) -> list[Job]:
    """The strict and the last-number evaluations of one checkpoint (the held-out set and the two-step set)."""
    py, regression = sys.executable, TWO_STEP.format(n=two_step)
    strict = [py, "-m", "megatron_rl.eval", "--run", str(run), "--checkpoints", ckpt, "--seeds", "1",
              "--regression", regression, "--out", str(out / "strict")]
    lenient = [py, "-m", "megatron_rl.eval", "--run", str(run), "--checkpoints", ckpt, "--seeds", "1",
               "--regression", regression + ",answer_extraction=last_number", "--out", str(out / "last_number"),
               "task.answer_extraction=last_number"]
    return [Job(f"eval-{name}-strict", strict, out / "strict" / "summary.json", deps),
            Job(f"eval-{name}-last_number", lenient, out / "last_number" / "summary.json", deps)]


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def _summary(eval_dir: Path) -> dict:
    """{set: metrics} of an evaluation of one checkpoint, from its records (the project's own reading)."""
    from megatron_rl.evaluation.pooling import load_records
    from megatron_rl.evaluation.records import eval_metrics, summarize

    records = load_records(eval_dir)  # one checkpoint, one sampling seed
    if len({r.get("checkpoint") for r in records}) != 1:
        raise ValueError(f"{eval_dir}: expected the evaluation of one checkpoint")
    out = {}
    for set_name in ("heldout", "two_step"):
        rows = [r for r in records if r.get("set", "heldout") == set_name]
        out[set_name] = {**eval_metrics(rows, [1]), "accuracy_ci": summarize(rows, [1])["metrics"]["accuracy"]["prompts"]}
    return out


def _t(values: list[float], one: Optional[dict] = None) -> str:
    """The mean over runs with its 95% t interval; for one run, its value (with `one`, a bootstrap interval
    over prompts, in brackets)."""
    from megatron_rl.evaluation.stats import t_interval

    if len(values) == 1:
        return f"{values[0]:.2f}" + (f" [{one['low']:.2f}, {one['high']:.2f}]" if one else "")
    ci = t_interval(values, 0.95)
    return f"{ci.mean:.2f} [{ci.low:.2f}, {ci.high:.2f}]"


def plot(work: Path, ours: dict[int, list[dict]], trl: dict[int, dict]) -> Path:
    """Training reward and wall time per step, ours (each seed) and TRL (each seed): WORK/learning.png."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    FigureCanvasAgg(fig)
    reward, times = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for s, rows in ours.items():
        steps = [r["step"] for r in rows]
        reward.plot(steps, [r["reward/mean"] for r in rows], color="C0", alpha=0.8, label=f"ours, seed {s}")
        times.plot(steps, [r["time/step"] for r in rows], color="C0", alpha=0.8, label=f"ours, seed {s}")
    for s, t in trl.items():
        steps = list(range(1, len(t["rewards"]) + 1))
        reward.plot(steps, t["rewards"], color="C1", alpha=0.8, label=f"TRL GRPOTrainer, seed {s}")
        times.plot(steps[:len(t["step_times"])], t["step_times"], color="C1", alpha=0.8, label=f"TRL, seed {s}")
    reward.set(xlabel="step", ylabel="training reward (strict)", ylim=(0, 1))
    times.set(xlabel="step", ylabel="wall time per step (s)", ylim=(0, None))
    reward.legend(fontsize=8)
    times.legend(fontsize=8)
    fig.tight_layout()
    out = work / "learning.png"
    fig.savefig(out, dpi=100)
    return out


def report(args: argparse.Namespace, work: Path) -> None:
    from megatron_rl.observability import read_metrics

    def metric_rows(seed: int) -> list[dict]:
        return [r for r in read_metrics(work / f"ours_seed{seed}" / "metrics.jsonl") if "reward/mean" in r]

    base = {reading: _summary(work / "eval_checkpoint" / reading) for reading in ("strict", "last_number")}
    ours = {s: {reading: _summary(work / f"eval_ours_seed{s}" / reading) for reading in ("strict", "last_number")}
            for s in args.seeds}
    trl = {s: {reading: _summary(work / f"eval_trl_seed{s}" / reading) for reading in ("strict", "last_number")}
           for s in args.trl_seeds}
    ours_train = {s: metric_rows(s) for s in args.seeds}
    trl_train = {s: json.loads((work / f"trl_seed{s}" / "result.json").read_text()) for s in args.trl_seeds}

    def col(evals: dict, reading: str, set_name: str, metric: str) -> str:
        one = next(iter(evals.values()))[reading][set_name]["accuracy_ci"] if metric == "accuracy" else None
        return _t([e[reading][set_name][metric] for e in evals.values()], one)

    def per_run(values: dict) -> str:
        return _t(list(values.values()))

    acc, trunc = "accuracy", "truncated"
    lines = [
        ("held-out accuracy, strict", _t([base['strict']['heldout'][acc]], base['strict']['heldout']['accuracy_ci']),
         col(ours, "strict", "heldout", acc), col(trl, "strict", "heldout", acc)),
        ("held-out accuracy, by the last number",
         _t([base['last_number']['heldout'][acc]], base['last_number']['heldout']['accuracy_ci']),
         col(ours, "last_number", "heldout", acc), col(trl, "last_number", "heldout", acc)),
        ("held-out answers cut at the limit", f"{base['strict']['heldout'][trunc]:.2f}",
         col(ours, "strict", "heldout", trunc), col(trl, "strict", "heldout", trunc)),
        ("two-step (not trained on), strict", _t([base['strict']['two_step'][acc]], base['strict']['two_step']['accuracy_ci']),
         col(ours, "strict", "two_step", acc), col(trl, "strict", "two_step", acc)),
        ("two-step, by the last number",
         _t([base['last_number']['two_step'][acc]], base['last_number']['two_step']['accuracy_ci']),
         col(ours, "last_number", "two_step", acc), col(trl, "last_number", "two_step", acc)),
        ("training reward, first 10% of steps", "",
         per_run({s: _edge_means([r["reward/mean"] for r in rows])[0] for s, rows in ours_train.items()}),
         per_run({s: _edge_means(t["rewards"])[0] for s, t in trl_train.items()})),
        ("training reward, last 10% of steps", "",
         per_run({s: _edge_means([r["reward/mean"] for r in rows])[1] for s, rows in ours_train.items()}),
         per_run({s: _edge_means(t["rewards"])[1] for s, t in trl_train.items()})),
        ("sampled answers in no asked format, first 10% of steps", "",
         per_run({s: _edge_means([r["reward/unformatted_share"] for r in rows])[0]
                  for s, rows in ours_train.items()}),
         per_run({s: _edge_means(t["unformatted"])[0] for s, t in trl_train.items()})),
        ("sampled answers in no asked format, last 10% of steps", "",
         per_run({s: _edge_means([r["reward/unformatted_share"] for r in rows])[1]
                  for s, rows in ours_train.items()}),
         per_run({s: _edge_means(t["unformatted"])[1] for s, t in trl_train.items()})),
        ("wall time per step, median (s)", "",
         per_run({s: statistics.median(r["time/step"] for r in rows) for s, rows in ours_train.items()}),
         per_run({s: statistics.median(t["step_times"]) for s, t in trl_train.items()})),
        ("tokens generated per step, median", "",
         per_run({s: statistics.median(r["rollout/generated_tokens"] for r in rows
                                       if "rollout/generated_tokens" in r) for s, rows in ours_train.items()}),
         per_run({s: statistics.median(t["completion_tokens"]) if t["completion_tokens"] else float("nan")
                  for s, t in trl_train.items()})),
    ]
    threads = "one pinned CPU and one thread per job, two jobs at a time" if args.slots > 1 else "every thread"
    trl_version = next(iter(trl_train.values()))["trl_version"] if trl_train else "-"
    print()
    print(f"SmolLM2-135M-Instruct, {RECIPE} ({args.steps} steps); ours seeds {args.seeds}, TRL {trl_version} "
          f"seeds {args.trl_seeds}; {threads}; greedy evaluation on the held-out set and the two-step set; "
          "several runs: mean [95% t interval over runs]; one run: value [95% bootstrap interval over prompts]")
    head = ("", "checkpoint", "ours", "TRL GRPOTrainer")
    widths = [max(len(r[i]) for r in lines + [head]) for i in range(4)]
    for r in [head, tuple("-" * w for w in widths)] + lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print(f"\ncurves: {plot(work, ours_train, trl_train)}")


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the converted checkpoint (launch/get_model.sh smollm2-135m)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="ours' seeds (default 0 1 2)")
    parser.add_argument("--trl-seeds", type=int, nargs="*", default=[0], help="TRL's seeds (default 0; none: skip)")
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run (the recipe's 30)")
    parser.add_argument("--slots", type=int, default=2 if (os.cpu_count() or 1) >= 2 else 1,
                        help="jobs at a time, each on its own CPU (default 2 where there are 2 CPUs)")
    parser.add_argument("--work-dir", type=Path, help="runs, evaluations and logs (kept); required")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra override of the recipe (repeatable), for both frameworks alike")
    parser.add_argument("--two-step", type=int, default=100, help="two-step problems evaluated (default 100)")
    parser.add_argument("--trl-micro-batch", type=int, default=8,
                        help="TRL's completions per forward/backward (gradient accumulation up to the batch)")
    parser.add_argument("--report-only", action="store_true", help="print the table from WORK, run nothing")
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = str(Path(args.model).resolve())
    if args.worker == "trl":
        return run_trl_worker(args)
    if args.work_dir is None:
        parser.error("--work-dir is required")
    if args.trl_seeds:
        _check_trl()  # fail before spending minutes on our side
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        py = sys.executable
        train: dict[str, Job] = {}
        for s in args.seeds:
            run = work / f"ours_seed{s}"
            train[f"ours{s}"] = Job(f"ours-seed{s}", [py, "-m", "megatron_rl.train",
                                                      *recipe_overrides(args, s),
                                                      f"run_dir={run}", "logging.progress=false"],
                                    work / f"ours-seed{s}.done",
                                    complete=functools.partial(_trained_to, run, args.steps))
        for s in args.trl_seeds:
            out = work / f"trl_seed{s}"
            out.mkdir(exist_ok=True)
            train[f"trl{s}"] = Job(f"trl-seed{s}", [py, str(Path(__file__).resolve()), "--worker", "trl",
                                                    "--model", args.model, "--seed", str(s), "--steps",
                                                    str(args.steps), "--out", str(out),
                                                    "--trl-micro-batch", str(args.trl_micro_batch),
                                                    *[f"--set={kv}" for kv in args.set]], work / f"trl-seed{s}.done")
        # ours and TRL of one seed side by side first, then the remaining seeds
        order = [k for s in args.trl_seeds for k in (f"ours{s}", f"trl{s}") if k in train]
        order += [k for k in train if k not in order]
        jobs = [train[k] for k in order]
        first = work / f"ours_seed{args.seeds[0]}"
        jobs += eval_jobs("checkpoint", first, args.model, work / "eval_checkpoint", [f"ours-seed{args.seeds[0]}"],
                          args.two_step)
        for s in args.seeds:
            jobs += eval_jobs(f"ours{s}", work / f"ours_seed{s}", "latest", work / f"eval_ours_seed{s}",
                              [f"ours-seed{s}"], args.two_step)
        for s in args.trl_seeds:
            jobs += eval_jobs(f"trl{s}", first, str(work / f"trl_seed{s}" / f"step_{args.steps}"),
                              work / f"eval_trl_seed{s}", [f"trl-seed{s}", f"ours-seed{args.seeds[0]}"], args.two_step)
        run_jobs(jobs, work, args.slots)
        for group, seeds in (("ours", args.seeds), ("trl", args.trl_seeds)):
            if len(seeds) > 1:
                for reading in ("strict", "last_number"):
                    for set_name in ("heldout", "two_step"):
                        subprocess.run([py, "-m", "megatron_rl.eval", "--pool",
                                        *[str(work / f"eval_{group}_seed{s}" / reading) for s in seeds],
                                        "--set", set_name, "--out", str(work / f"pooled_{group}_{reading}_{set_name}")],
                                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    report(args, work)
    print(f"\nwork directory: {work} (pooled intervals: {work}/pooled_*/pooled.md)")


if __name__ == "__main__":
    main()
