"""Learning benchmark: this framework's GRPO against TRL's `GRPOTrainer` on the same small model,
task and sample budget; final reward and wall time per step as ratios (ours / TRL).

    .venv/bin/python benchmarks/learning.py [--steps 100] [--warm-steps 70] [--eval-prompts 1000]

Prerequisites, checked and installed by the script itself before any work: `trl` (the `bench` extra,
`pip install -e '.[bench]'`, which keeps the installed torch) and bubblewrap for the sandbox rewards
(`launch/ensure_bwrap.sh`, as the demo; where it cannot be installed, ours runs the sandbox's process runtime,
said in the report). No model or data is downloaded: the model is the demo's tiny Qwen2 (char tokenizer).

1. Common start: `python -m megatron_rl.train +experiment=demo_countdown mode=sft` runs the
   demo's supervised warm start (`--warm-steps` steps at `task.sft_warmup_lr`, batch 256) and
   exports an HF checkpoint (`<work>/warm/hf/step_N`). Both frameworks start from it.
2. Ours, twice: `python -m megatron_rl.train +experiment=demo_countdown model.path=<start>
   task.sft_warmup_steps=0 num_steps=<steps>` (GRPO, PPO-clip 0.2, 2 inner updates, token-mean
   loss, kl 0), exporting the final model as HF: with rewards from the sandbox service (the demo's path:
   each step's expressions run in one bubblewrap execution), and with `task.reward=
   megatron_rl.data.countdown:reward`, the in-process checker TRL's arm calls (the same work as TRL's).
3. TRL: `GRPOTrainer` in a subprocess (`--worker trl`) on the same checkpoint, the same training
   prompts (`countdown.format_prompt`, no chat template), reward `countdown.score` (the reference
   checker the sandbox verifier agrees with), and every hyperparameter read from ours' resolved
   `config.yaml`: temperature, max_completion_length, num_generations, prompts per step, lr
   (constant), Adam betas/eps, grad clip, epsilon, num_iterations = inner updates, beta 0,
   loss_type "dapo" (= token mean over the batch), fp32, CPU.
4. One evaluation function for the start and both final models: each held-out prompt sampled
   once at the rollout temperature with plain `transformers` `generate`, scored with
   `countdown.score`, same seed.

Prints a side-by-side table of the three arms (training reward over the first and last 10% of steps, held-out
accuracy, tokens generated per step, median wall time per step, whole-run wall and CPU time) and the ratios of
each of ours to TRL, and a RESULT line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRL_MISSING = "TRL is not installed in this environment and `pip install -e '.[bench]'` failed"


def _check_trl(install: bool = False) -> str:
    """The installed trl version; with `install`, the bench extra is installed first when trl is missing.
    Exits with a clear message when it cannot be had."""
    import importlib.util

    if install and importlib.util.find_spec("trl") is None:
        print("[prerequisites] trl is missing: pip install -e '.[bench]'", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-e",
                        f"{ROOT}[bench]"], check=False)
    try:
        import trl  # noqa: F401
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except ImportError as exc:
        sys.exit(f"benchmarks/learning.py: {TRL_MISSING} ({exc})")
    return trl.__version__


def _sandbox_overrides() -> list[str]:
    """Ours' rewards run in the local sandbox: bubblewrap, installed as the demo does; else the process runtime."""
    if subprocess.run(["bash", str(ROOT / "launch" / "ensure_bwrap.sh")]).returncode == 0:
        return []
    print("[prerequisites] no bubblewrap: ours' sandbox runs the process runtime (NO isolation)", flush=True)
    return ["sandbox.runtime=process", "sandbox.allow_unisolated=true"]


BUSY: dict[str, float] = {}  # phase -> CPUs busy with other processes just before it


def _busy_cpus(seconds: float = 2.0) -> float:
    """CPUs kept busy by other processes (this one idles meanwhile), from /proc/stat; nan if unreadable."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])
    try:
        busy0, total0 = sample()
        time.sleep(seconds)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return float("nan")
    return (busy1 - busy0) / max(1, total1 - total0) * (os.cpu_count() or 1)


def _run(cmd: list[str], log: Path, what: str) -> tuple[float, float]:
    """Run `cmd` with output to `log`; its (wall, CPU) seconds. Exit with the log's tail on failure."""
    BUSY[what] = _busy_cpus()
    if BUSY[what] > 0.25:
        print(f"[{what}] warning: other processes keep {BUSY[what]:.1f} of {os.cpu_count()} CPUs busy; "
              "wall times will be inflated (run on an idle machine)", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    print(f"[{what}] {' '.join(cmd)}\n[{what}] log: {log}", flush=True)
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        sys.exit(f"[{what}] failed with exit code {rc}; last lines of {log}:\n{tail}")
    print(f"[{what}] done in {wall:.0f}s wall, {cpu:.0f}s CPU", flush=True)
    return wall, cpu


def _edge_means(values: list[float]) -> tuple[float, float]:
    """Means over the first and the last 10% of `values` (at least one value each)."""
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k, sum(values[-k:]) / k


# ---------------------------------------------------------------------------------------------
# Shared evaluation
# ---------------------------------------------------------------------------------------------

def evaluate(model_dir: Path, tokenizer_dir: Path, problems, max_new_tokens: int, temperature: float,
             seed: int, batch_size: int = 250) -> float:
    """Held-out accuracy of the HF model in `model_dir`: one sample per problem, scored by rule."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from megatron_rl.data import countdown
    from megatron_rl.data.tokenizer import load_tokenizer

    transformers_logging.disable_progress_bar()
    tokenizer = load_tokenizer(str(tokenizer_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    torch.manual_seed(seed)
    correct = 0.0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        enc = tokenizer([countdown.format_prompt(p) for p in chunk], add_special_tokens=False, padding=True,
                        padding_side="left", return_tensors="pt")
        with torch.no_grad():
            out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], do_sample=True,
                                 temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(countdown.score(p, t) for p, t in zip(chunk, texts))
    return correct / len(problems)


# ---------------------------------------------------------------------------------------------
# TRL worker (a subprocess of the driver, so both frameworks run as their own process)
# ---------------------------------------------------------------------------------------------

def run_trl_worker(args: argparse.Namespace) -> None:
    version = _check_trl()
    import torch
    from datasets import Dataset
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rl.data import countdown
    from megatron_rl.data.tokenizer import load_tokenizer

    cfg = OmegaConf.load(args.ours_config)  # ours' resolved run configuration: the single source of settings
    out = Path(args.out)
    n = cfg.rollout.n_samples_per_prompt
    inner = cfg.algorithm.num_inner_updates
    problems = countdown.generate_problems(cfg.task.num_train, seed=cfg.task.seed, split="train")
    dataset = Dataset.from_list([{"prompt": countdown.format_prompt(p), "numbers": list(p.numbers),
                                  "target": p.target} for p in problems])
    rewards: list[float] = []
    tokens: list[int] = []  # generated per RL step: one reward call per generation batch

    def countdown_reward(prompts, completions, numbers, target, completion_ids, **_):
        scores = [countdown.score(countdown.CountdownProblem(tuple(nums), int(t), ""), c)
                  for c, nums, t in zip(completions, numbers, target)]
        rewards.append(sum(scores) / len(scores))
        tokens.append(sum(len(ids) for ids in completion_ids))
        return scores

    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(time.perf_counter())

        def on_step_end(self, _args, state, *_, **__):
            if state.global_step % inner == 0:  # one RL step = `inner` optimizer steps on one generation batch
                ends.append(time.perf_counter())

    tokenizer = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, fp16=False, seed=cfg.seed,
        per_device_train_batch_size=cfg.global_batch_size, gradient_accumulation_steps=1,
        num_generations=n, max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k if cfg.rollout.top_k > 0 else 0,
        learning_rate=cfg.optimizer.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.optimizer.weight_decay, adam_beta1=cfg.optimizer.adam_beta1,
        adam_beta2=cfg.optimizer.adam_beta2, adam_epsilon=cfg.optimizer.adam_eps,
        max_grad_norm=cfg.optimizer.clip_grad, gradient_checkpointing=False,
        num_iterations=inner, epsilon=cfg.algorithm.eps_clip, beta=0.0, loss_type="dapo", scale_rewards="group",
        max_steps=args.steps * inner, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[countdown_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    trainer.save_model(str(out / "final"))
    step_times = [b - a for a, b in zip(ends, ends[1:])]
    (out / "result.json").write_text(json.dumps({
        "trl_version": version, "rewards": rewards, "tokens": tokens, "step_times": step_times, "train_wall_s": wall,
        "threads": torch.get_num_threads()}, indent=1))
    print(f"TRL: {len(rewards)} RL steps ({args.steps * inner} optimizer steps) in {wall:.0f}s; "
          f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f}", flush=True)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="RL steps per framework (default %(default)s)")
    parser.add_argument("--warm-steps", type=int, default=70,
                        help="supervised warm-start steps of the common starting point (the demo's 70)")
    parser.add_argument("--eval-prompts", type=int, default=1000, help="held-out problems, one sample each")
    parser.add_argument("--start", type=Path, default=None,
                        help="an existing common start (HF checkpoint of this model) instead of running the warm start")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra override of our RL run (repeatable), e.g. seed=1; TRL reads ours' resolved "
                             "config, so the settings both share (seed, lr, rollout.*, batch) follow")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a new temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (checkpoints, logs)")
    parser.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--ours-config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "trl":
        return run_trl_worker(args)
    if args.steps < 1 or args.warm_steps < 1:
        parser.error("--steps and --warm-steps must be >= 1")
    trl_version = _check_trl(install=True)  # before spending minutes on our side
    sandbox = _sandbox_overrides()

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="learning_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    base = [py, "-m", "megatron_rl.train", "+experiment=demo_countdown", "logging.progress=false",
            "checkpoint.save_every=0", "checkpoint.save_at_end=false", "checkpoint.hf_export_at_end=true",
            "checkpoint.resume=false", *sandbox]

    # 1. the common starting point: the demo's warm start, exported as an HF checkpoint
    from omegaconf import OmegaConf

    if args.start is None:
        warm_dir = work / "warm"
        shutil.rmtree(warm_dir, ignore_errors=True)
        demo = OmegaConf.load(ROOT / "conf/experiment/demo_countdown.yaml")
        _run(base + ["mode=sft", f"run_dir={warm_dir}", f"num_steps={args.warm_steps}",
                     f"optimizer.lr={demo.task.sft_warmup_lr}"], work / "warm.log", "warm start")
        start_ckpt = warm_dir / "hf" / f"step_{args.warm_steps:08d}"
    else:
        start_ckpt = args.start.resolve()
        if not (start_ckpt / "config.json").is_file():
            parser.error(f"--start {start_ckpt}: not an HF checkpoint directory (no config.json)")

    # 2. ours: rewards from the sandbox service (the demo's path), then from the same in-process checker as TRL's
    from megatron_rl.observability import read_metrics

    ours: dict[str, dict] = {}
    for arm, extra in (("ours", []), ("ours_inproc", ["task.reward=megatron_rl.data.countdown:reward"])):
        run_dir = work / arm
        shutil.rmtree(run_dir, ignore_errors=True)
        wall, cpu = _run(base + [f"run_dir={run_dir}", f"model.path={start_ckpt}", "task.sft_warmup_steps=0",
                                 f"num_steps={args.steps}", "task.eval_every=0", "task.num_eval=16",
                                 "task.eval_samples=1", *extra, *args.set], work / f"{arm}.log", arm)
        rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
        ours[arm] = {"wall": wall, "cpu": cpu, "rewards": [r["reward/mean"] for r in rows],
                     "times": [r["time/step"] for r in rows], "tokens": [r["rollout/generated_tokens"] for r in rows],
                     "final": run_dir / "hf" / f"step_{args.steps:08d}"}
    ours_dir = work / "ours"
    cfg = OmegaConf.load(ours_dir / "config.yaml")

    # 3. TRL
    trl_dir = work / "trl"
    shutil.rmtree(trl_dir, ignore_errors=True)
    trl_dir.mkdir()
    trl_wall, trl_cpu = _run([py, str(Path(__file__).resolve()), "--worker", "trl", "--steps", str(args.steps),
                              "--model", str(start_ckpt), "--ours-config", str(ours_dir / "config.yaml"),
                              "--out", str(trl_dir)], work / "trl.log", "trl")
    trl = json.loads((trl_dir / "result.json").read_text())

    # 4. shared evaluation
    from megatron_rl.data import countdown

    held_out = countdown.generate_problems(args.eval_prompts, seed=cfg.task.seed, split="eval")
    ev = dict(tokenizer_dir=start_ckpt, problems=held_out, max_new_tokens=cfg.rollout.max_new_tokens,
              temperature=cfg.rollout.temperature, seed=cfg.seed)
    acc_start = evaluate(start_ckpt, **ev)
    for arm in ours.values():
        arm["acc"] = evaluate(arm["final"], **ev)
    acc_trl = evaluate(trl_dir / "final", **ev)

    # 5. report
    prompts = cfg.global_batch_size // cfg.rollout.n_samples_per_prompt
    import torch

    print()
    origin = f"warm start {args.warm_steps} SFT steps" if args.start is None else f"start {start_ckpt}"
    print(f"Countdown, tiny Qwen2 ({origin}), {args.steps} RL steps x {prompts} prompts x "
          f"{cfg.rollout.n_samples_per_prompt} samples, max {cfg.rollout.max_new_tokens} new tokens, lr "
          f"{cfg.optimizer.lr:g}, {cfg.algorithm.num_inner_updates} inner updates, seed {cfg.seed}"
          f"{' (' + ' '.join(args.set) + ')' if args.set else ''}; trl {trl_version}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads; CPUs busy with other "
          f"processes just before: " + ", ".join(f"{k} {v:.2f}" for k, v in BUSY.items()))
    print(f"held-out accuracy of the common start ({len(held_out)} prompts, 1 sample each): {acc_start:.3f}")
    print()

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b else "n/a"

    arms = [ours["ours"], ours["ours_inproc"], {"wall": trl_wall, "cpu": trl_cpu, "rewards": trl["rewards"],
                                                 "times": trl["step_times"], "tokens": trl["tokens"], "acc": acc_trl}]
    for arm in arms:
        arm["first"], arm["last"] = _edge_means(arm["rewards"])
        arm["step"] = statistics.median(arm["times"])
        arm["mean_tokens"] = statistics.mean(arm["tokens"])
    measures = [("training reward, first 10% of steps", "first", "{:.3f}", False),
                ("training reward, last 10% of steps", "last", "{:.3f}", True),
                ("held-out accuracy after RL", "acc", "{:.3f}", True),
                ("tokens generated per step, mean", "mean_tokens", "{:.0f}", True),
                ("wall time per step, median (s)", "step", "{:.2f}", True),
                ("whole run wall time (s)", "wall", "{:.0f}", True),
                ("whole run CPU time (s)", "cpu", "{:.0f}", True)]
    table = [(label, *(fmt.format(a[key]) for a in arms),
              *((ratio(arms[0][key], arms[2][key]), ratio(arms[1][key], arms[2][key])) if ratios else ("", "")))
             for label, key, fmt, ratios in measures]
    head = ("", "ours (sandbox rewards)", "ours (in-process rewards)", "TRL GRPOTrainer", "ours / TRL",
            "ours in-process / TRL")
    widths = [max(len(r[i]) for r in table + [head]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths)] + table:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print()
    print(f"ratios ours / TRL: final reward (last 10% of steps) {ratio(arms[0]['last'], arms[2]['last'])}, "
          f"wall time per step {ratio(arms[0]['step'], arms[2]['step'])}; with TRL's in-process reward: "
          f"{ratio(arms[1]['last'], arms[2]['last'])}, {ratio(arms[1]['step'], arms[2]['step'])}")
    print("RESULT " + json.dumps({"step_ratio_sandbox": arms[0]["step"] / arms[2]["step"],
                                  "step_ratio_inprocess": arms[1]["step"] / arms[2]["step"],
                                  "acc_ours": arms[0]["acc"], "acc_ours_inprocess": arms[1]["acc"],
                                  "acc_trl": acc_trl}))
    if args.keep or args.work_dir:
        print(f"work directory: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
