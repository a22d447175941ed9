"""`run_rl`: build the run, start it (a warm start and the step-0 evaluation) or resume it exactly from its
latest checkpoint, then step, evaluate, log and checkpoint until num_steps or a stop signal."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Optional

from megatron_rl.rl.evaluate import evaluate
from megatron_rl.rl.state import RunState, build_run
from megatron_rl.rl.step import rl_step
from megatron_rl.rl.warm_start import begin_warm_start, warm_start

logger = logging.getLogger(__name__)
SUMMARY = {"reward/mean": "reward", "eval/accuracy": "eval", "kl/policy_old_new": "kl_old_new", "kl/ref": "kl_ref",
           "entropy": "ent", "clip_frac": "clip", "critic/value_loss": "vloss", "distill/reverse_kl": "distill_kl",
           "distill/topk_kl": "topk_kl", "response_length/mean": "len", "rollout/tokens_per_s": "gen_tok/s",
           "tokens_per_s": "train_tok/s", "time/step": "time"}
PLOTS = ["reward/mean", "eval/accuracy", "eval/pass@k", "kl/policy_old_new", "kl/ref", "entropy", "tokens_per_s",
         "rollout/tokens_per_s", "time/step", "critic/value_loss", "critic/explained_variance", "distill/reverse_kl",
         "distill/topk_kl"]


def run_rl(rt) -> dict[str, float]:
    """The RL run of `rt.cfg`; the last step's metrics ({} when a signal stopped the warm start)."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from megatron_rl.observability import format_step_summary

    cfg, run = rt.cfg, build_run(rt)
    start_step = start(rt, run)
    if start_step is None:  # stopped by a signal during the warm start (checkpointed)
        run.close()
        return {}
    show = rt.is_main and cfg.logging.progress
    # A step's number is the updates done once it ends: its metrics.jsonl row, log lines and checkpoint
    bar = tqdm(range(start_step + 1, cfg.num_steps + 1), desc="rl", unit="step", initial=start_step,
               total=cfg.num_steps, disable=not show)
    metrics: dict[str, float] = {}
    with logging_redirect_tqdm() if show else contextlib.nullcontext():
        for step in bar:
            began = time.perf_counter()
            metrics = rl_step(rt, run, step - 1)  # which counts the steps before it
            every = cfg.algorithm.ref_update_every
            if every and run.reference is not None and step % every == 0:  # the KL anchor moves to the policy
                run.reference = run.trainer.snapshot_weights()
            if (cfg.task.eval_every and step % cfg.task.eval_every == 0) or step == cfg.num_steps:
                metrics.update(evaluate(rt, run, step=step))
            metrics["time/step"] = time.perf_counter() - began
            run.writer.log(step, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            if step == 1 or step % cfg.logging.log_every == 0 or step == cfg.num_steps:
                logger.info(format_step_summary(step, metrics, SUMMARY))
            state = functools.partial(run.state_dict, step)  # made only when a checkpoint is written
            run.checkpoints.after_step(step, state, metrics)
            if rt.preemption.stop_agreed(step, cfg.num_steps, save_seconds=run.checkpoints.longest_save_s):
                rt.preemption.save_and_mark(run.checkpoints, step, state, metrics)
                break
    finish(rt, run)
    return metrics


def start(rt, run: RunState) -> Optional[int]:
    """Resume from the run directory's latest checkpoint, or start afresh: initial weights, the warm start,
    RL's optimizer and the step-0 evaluation. Then the critic and the reference policy. Returns the steps
    already done, or None when a stop signal ended the warm start."""
    cfg = rt.cfg
    saved = run.checkpoints.to_resume()
    in_warm_start = saved is not None and saved.get("warm_start") is not None  # a warm start stopped by a signal
    if in_warm_start:
        begin_warm_start(rt, run, saved["warm_start"])  # its optimizer, into which the checkpoint loads
    resumed = run.checkpoints.resume()
    rt.preemption.watch()  # from here SIGUSR1/SIGTERM mean: finish this step, checkpoint, stop
    if resumed is None or in_warm_start:
        if resumed is None:
            run.trainer.initialize_weights()
        if not warm_start(rt, run, resumed):
            return None
        resumed = None  # RL starts afresh after the warm start
        run.trainer.reset_optimizer(cfg.optimizer, cfg.num_steps * cfg.algorithm.num_inner_updates)
        run.writer.rewind(0)  # a run started again before its first checkpoint logs its steps afresh
        first_eval = evaluate(rt, run, step=0)
        if first_eval:  # the policy RL starts from: metrics.jsonl's step 0
            run.writer.log(0, first_eval)
        if cfg.algorithm.kl_coef > 0:  # reference = the policy RL started from (kept in host memory)
            run.reference = run.trainer.snapshot_weights()
        start_step = 0
    else:
        run.load_state_dict(resumed)
        start_step = resumed["rl_step"]
        run.writer.rewind(start_step + 1)  # the steps after the checkpoint's are logged again
    if run.critic is not None:
        start_critic(run, resumed)
    return start_step


def start_critic(run: RunState, resumed: Optional[dict]) -> None:
    """A critic not restored from the checkpoint starts from the policy's weights (after its warm start)
    with a zero value head."""
    if resumed is not None and resumed.get("critic"):
        return
    if resumed is not None:
        logger.warning("the checkpoint this run resumes from holds no critic (written without algorithm.critic): "
                       "the critic starts from the resumed policy's weights")
    run.critic.copy_body_from(run.trainer)


def finish(rt, run: Any) -> None:
    """Close the run; rank 0 plots the metrics and logs the run's summary."""
    from megatron_rl.observability import read_metrics
    from megatron_rl.observability.plots import plot_metrics
    from megatron_rl.observability.summary import rl_summary

    run.close()
    if not rt.is_main:
        return
    rows = read_metrics(rt.run_dir / "metrics.jsonl")  # every step's, also those of a resumed run's earlier jobs
    plot_metrics(rt.run_dir / "metrics.jsonl", rt.run_dir / "plots", [k for k in PLOTS if any(k in r for r in rows)])
    summary = rl_summary(rows, rt.cfg.task.sft_warmup_steps)
    if summary:
        logger.info("%s; run directory %s", summary, rt.run_dir)
