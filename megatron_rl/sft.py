"""Supervised fine-tuning on the Megatron trainer: prompt + response samples, loss on the
response tokens only. Warm-starts the small model before RL, and is the main job until the
RL loop lands.

    python -m megatron_rl.sft num_steps=200 optimizer.lr=1e-3
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Sequence

import torch

from megatron_rl import runtime
from megatron_rl.trainer.packing import Sample

logger = logging.getLogger(__name__)

SUMMARY_KEYS = {"loss": "loss", "eval_loss": "eval", "grad_norm": "gnorm", "lr": "lr",
                "tokens_per_s": "tok/s", "step_time_s": "time"}


def prompt_response_sample(tokenizer, prompt: str, response: str) -> Sample:
    """Tokens of prompt + response + eos; the loss covers the response and the eos."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    tokens = torch.tensor(p + r, dtype=torch.long)
    mask = torch.zeros(len(tokens) - 1)
    mask[len(p) - 1:] = 1.0
    return Sample(tokens, mask)


def load_pairs(task, split: str) -> list[tuple[str, str]]:
    """(prompt as the model sees it, reference response) of a task's split; rows without a
    reference response are an error (SFT has nothing to learn from them)."""
    pairs = [(p.text, p.reference) for p in task.prompts(split)]
    empty = sum(not reference.strip() for _, reference in pairs)
    if empty:
        raise ValueError(f"task {task.cfg.name}: {empty} {split} rows have no reference response "
                         f"(column {task.cfg.response_key!r}); SFT needs one per row")
    return pairs


def eval_loss(trainer, samples: Sequence[Sample]) -> float:
    logprobs, _ = trainer.forward_logprobs(samples)
    total = sum(float(-(lp * s.loss_mask).sum()) for lp, s in zip(logprobs, samples))
    return total / max(1.0, sum(float(s.loss_mask.sum()) for s in samples))


def run_sft(rt: runtime.Runtime) -> dict[str, float]:
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.data.sampler import EpochSampler
    from megatron_rl.data.tasks import Task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.observability import format_step_summary
    from megatron_rl.observability.plots import plot_metrics
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    cfg = rt.cfg
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code)
    task = Task(cfg.task, tokenizer)
    train = [prompt_response_sample(tokenizer, p, r) for p, r in load_pairs(task, "train")]
    held_out = [prompt_response_sample(tokenizer, p, r) for p, r in load_pairs(task, "eval")]
    trainer = Trainer(cfg.model, cfg.optimizer, rt.groups, TrainerOptions(
        micro_batch_tokens=cfg.micro_batch_tokens,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        deterministic=cfg.deterministic, total_steps=cfg.num_steps,
        pad_token_id=tokenizer.pad_token_id))
    sampler = EpochSampler(len(train), cfg.seed)
    checkpoints = CheckpointManager(cfg.checkpoint, rt.run_dir, trainer, cfg, cfg.num_steps, tokenizer)
    resumed = checkpoints.resume()
    rt.preemption.watch()  # from here SIGUSR1/SIGTERM mean: finish this step, checkpoint, stop
    if resumed is None:
        trainer.initialize_weights()
        rt.writer.rewind(0)  # a run started again before its first checkpoint logs its steps afresh
        first_eval = eval_loss(trainer, held_out)
        rt.writer.log(0, {"eval_loss": first_eval})  # before any update: step 0 (docs/rl.md, "Metrics")
    else:
        sampler.load_state_dict(resumed["sampler"])
        first_eval = resumed["first_eval"]
        rt.writer.rewind(trainer.step + 1)  # the steps after the checkpoint's are logged again
    logger.info("SFT: %d train / %d held-out samples; held-out loss before: %.4f",
                len(train), len(held_out), first_eval)

    metrics: dict[str, float] = {}
    show_bar = rt.is_main and cfg.logging.progress
    # a step's number is the updates done once it ends: its metrics.jsonl row, log line and checkpoint
    bar = tqdm(range(trainer.step + 1, cfg.num_steps + 1), desc="sft", unit="step", disable=not show_bar,
               initial=trainer.step, total=cfg.num_steps)
    stopped = False

    def state() -> dict:  # what a checkpoint holds besides model, optimizer and RNG
        return {"sampler": sampler.state_dict(), "first_eval": first_eval}

    # The redirect would drop the console handler's level, so only rank 0's bar uses it.
    with logging_redirect_tqdm() if show_bar else contextlib.nullcontext():
        for step in bar:
            batch = [train[i] for i in sampler.next_batch(cfg.global_batch_size)]
            start = time.perf_counter()
            metrics = trainer.train_step(batch)
            metrics["step_time_s"] = time.perf_counter() - start
            metrics["tokens_per_s"] = sum(s.tokens.numel() for s in batch) / metrics["step_time_s"]
            if step == cfg.num_steps:
                metrics["eval_loss"] = eval_loss(trainer, held_out)
            rt.writer.log(step, metrics)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
            if step == 1 or step % cfg.logging.log_every == 0 or step == cfg.num_steps:
                logger.info(format_step_summary(step, metrics, SUMMARY_KEYS))
            checkpoints.after_step(step, state, metrics)
            if rt.preemption.stop_agreed(step, cfg.num_steps, save_seconds=checkpoints.longest_save_s):
                rt.preemption.save_and_mark(checkpoints, step, state, metrics)
                stopped = True
                break
    if rt.is_main:
        plot_metrics(rt.run_dir / "metrics.jsonl", rt.run_dir / "plots", ["loss", "grad_norm", "tokens_per_s"])
    if rt.is_main and not stopped:
        logger.info("SFT done: train loss %.4f; held-out loss %.4f -> %.4f; run directory %s",
                    metrics.get("loss", float("nan")), first_eval, metrics.get("eval_loss", float("nan")),
                    rt.run_dir)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    # mode=sft last: this entry point runs SFT whatever the config says, and the checks are SFT's
    rt = runtime.start([*(sys.argv[1:] if argv is None else argv), "mode=sft"], "megatron_rl.sft")
    if rt is None:
        return
    try:
        run_sft(rt)
    finally:
        runtime.finish(rt)


if __name__ == "__main__":
    main()
