"""The main job: `python -m megatron_rl.train [overrides]` (or `sbatch slurm/run.sh [overrides]`).

`mode=rl` (the default): an optional supervised warm start, then per step
    rollout (colocated: offload trainer -> weight sync -> generate) -> rewards (async)
    -> advantages -> old log-probs -> policy update(s) -> eval / checkpoint / metrics.
`mode=sft` runs the supervised entry point (`megatron_rl.sft`) instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from typing import Optional, Sequence

from megatron_rl import runtime

logger = logging.getLogger(__name__)
SUMMARY = {"reward/mean": "reward", "eval/accuracy": "eval", "kl/policy_old_new": "kl_old_new", "kl/ref": "kl_ref",
           "entropy": "ent", "clip_frac": "clip", "critic/value_loss": "vloss", "response_length/mean": "len",
           "rollout/tokens_per_s": "gen_tok/s", "tokens_per_s": "train_tok/s", "time/step": "time"}
PLOTS = ["reward/mean", "eval/accuracy", "eval/pass@k", "kl/policy_old_new", "kl/ref", "entropy", "tokens_per_s",
         "rollout/tokens_per_s",
         "time/step", "critic/value_loss", "critic/explained_variance"]


def check_train_config(cfg) -> None:
    """Cross-field checks of a run's config (megatron_rl/config/run_checks.py), before any work."""
    from megatron_rl.config.run_checks import check_run_config

    check_run_config(cfg)


def build(rt, evaluation: bool = False):
    """Everything one RL run holds: tokenizer, task, trainer, engine, controller, rewards (and, with
    algorithm.critic, the critic).

    `evaluation` (offline evaluation of checkpoints, megatron_rl/evaluation/runner.py): no critic, and the
    rollouts come from this job's own engine, also for a disaggregated run's config (no generators start).
    A disaggregated training run uses its own engine only to evaluate: without held-out prompts it builds none."""
    from megatron_rl.algorithms.objective import make_policy_loss_fn, make_value_loss_fn
    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.colocate.controller import ColocationController
    from megatron_rl.data.domains import make_sampler, make_task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.data.env_pool import make_env_pool
    from megatron_rl.rewards.service import RewardService
    from megatron_rl.rl_domains import make_joint
    from megatron_rl.rollout.factory import make_engine
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    cfg = rt.cfg
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code)
    task = make_task(cfg, tokenizer)  # a MultiTask over cfg.domains when set
    options = TrainerOptions(
        micro_batch_tokens=cfg.micro_batch_tokens, use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce, deterministic=cfg.deterministic,
        total_steps=cfg.num_steps * cfg.algorithm.num_inner_updates, pad_token_id=tokenizer.pad_token_id,
        logprob_temperature=cfg.rollout.temperature or 1.0,  # 0 (greedy): log-probs at temperature 1
        routing_replay=cfg.algorithm.routing_replay != "none")
    trainer = Trainer(cfg.model, cfg.optimizer, rt.groups, options)
    # PPO's value model: the policy's architecture with a value head, its weights copied from the policy
    # once RL starts (`start_critic`)
    critic = None
    if cfg.algorithm.critic and not evaluation:
        critic = Trainer(cfg.model, critic_optimizer(cfg), rt.groups, options, head="value")
    train_prompts, eval_prompts = task.prompts("train"), task.prompts("eval")
    disaggregated = cfg.rollout.mode == "disaggregated" and not evaluation
    engine = None
    if disaggregated and not eval_prompts:
        logger.info("rollout.mode=disaggregated without held-out prompts to evaluate: the trainer ranks start no "
                    "engine of their own")
    else:
        # The engine sizes its KV cache from the device memory free when it starts: the trainer's (and the
        # critic's) is handed over first, as in every rollout (no-ops on CPU)
        for model in (trainer, critic):
            if model is not None:
                model.offload()
        engine = make_engine(cfg, rt.groups, tokenizer, local_rank=rt.env.local_rank,
                             local_world_size=rt.env.local_world_size, work_dir=rt.run_dir)
        engine.release_memory()  # the controller resumes it for each rollout
        for model in (trainer, critic):
            if model is not None:
                model.onload()
    controller = ColocationController(trainer, engine, critic=critic, weight_sync=cfg.rollout.weight_sync)
    controller.log_memory_plan()
    addresses = runtime.sandbox_addresses(rt) if task.needs_sandbox else []
    rewards = RewardService(task.verifier_factory(addresses))
    check_sample_budget(cfg, train_prompts)
    sampler = make_sampler(task, train_prompts, cfg.seed)
    if disaggregated:  # generator processes + experience buffer; evaluation stays colocated
        from megatron_rl.disagg.controller import DisaggregatedController

        controller = DisaggregatedController(rt, controller, train_prompts, sampler, task.stop_token_ids, addresses)
    checkpoints = CheckpointManager(cfg.checkpoint, rt.run_dir, trainer, cfg, cfg.num_steps, tokenizer)
    checkpoints.critic = critic
    return dict(tokenizer=tokenizer, task=task, trainer=trainer, engine=engine, controller=controller,
                rewards=rewards, loss_fn=make_policy_loss_fn(cfg.algorithm), train=train_prompts, eval=eval_prompts,
                sampler=sampler, domains=make_joint(cfg, task, sampler),
                env_pool=make_env_pool(cfg, task, train_prompts), checkpoints=checkpoints,
                **({"critic": critic, "value_loss_fn": make_value_loss_fn(cfg.algorithm.value_clip)} if critic else {}))


def critic_optimizer(cfg):
    """The critic's optimizer settings: optimizer.*, with algorithm.critic_lr (and min_lr at most that)."""
    return dataclasses.replace(cfg.optimizer, lr=cfg.algorithm.critic_lr,
                               min_lr=min(cfg.optimizer.min_lr, cfg.algorithm.critic_lr))


def start_critic(parts: dict, resumed: Optional[dict]) -> None:
    """A critic not restored from the checkpoint starts from the policy's weights (after its warm start)
    with a zero value head."""
    critic = parts["critic"]
    if resumed is not None and resumed.get("critic"):
        return
    if resumed is not None:
        logger.warning("the checkpoint this run resumes from holds no critic (written without algorithm.critic): "
                       "the critic starts from the resumed policy's weights")
    critic.copy_body_from(parts["trainer"])


def check_sample_budget(cfg, prompts) -> None:
    """The longest single-turn prompt plus a full response must fit one micro-batch row: found now,
    before any generation, rather than when the first batch is packed (ValueError with the fix)."""
    longest = max((len(p.tokens) for p in prompts), default=0)  # agent prompts carry no tokens here
    if longest and longest + cfg.rollout.max_new_tokens > cfg.micro_batch_tokens:
        raise ValueError(f"the longest training prompt has {longest} tokens; with rollout.max_new_tokens="
                         f"{cfg.rollout.max_new_tokens} a sample can reach {longest + cfg.rollout.max_new_tokens} "
                         f"tokens, more than micro_batch_tokens={cfg.micro_batch_tokens}: raise micro_batch_tokens "
                         "or leave long prompts out (task.max_prompt_tokens)")


def run_rl(rt) -> dict[str, float]:
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from megatron_rl.observability import format_step_summary
    from megatron_rl.rl_step import begin_warm_start, evaluate, rl_step, warm_start

    cfg, parts = rt.cfg, build(rt)
    saved = parts["checkpoints"].to_resume()
    in_warm_start = saved is not None and saved.get("warm_start") is not None  # a warm start stopped by a signal
    if in_warm_start:
        begin_warm_start(rt, parts, saved["warm_start"])  # its optimizer, into which the checkpoint loads
    resumed = parts["checkpoints"].resume()
    rt.preemption.watch()  # from here SIGUSR1/SIGTERM mean: finish this step, checkpoint, stop
    if resumed is None or in_warm_start:
        if resumed is None:
            parts["trainer"].initialize_weights()
        if not warm_start(rt, parts, resumed):  # stopped by a signal (checkpointed)
            close_rl(rt, parts)
            return {}
        resumed = None  # RL starts afresh after the warm start
        parts["trainer"].reset_optimizer(cfg.optimizer, cfg.num_steps * cfg.algorithm.num_inner_updates)
        rt.writer.rewind(0)  # a run started again before its first checkpoint logs its steps afresh
        start_step, first_eval = 0, evaluate(rt, parts, step=0)
        if first_eval:  # the policy RL starts from: metrics.jsonl's step 0
            rt.writer.log(0, first_eval)
    else:
        parts["sampler"].load_state_dict(resumed["sampler"])
        if parts["domains"]:
            parts["domains"].load_state_dict(resumed.get("domains"))
        if parts["env_pool"] and resumed.get("env_pool"):  # none saved: the pool was switched on now, starts fresh
            parts["env_pool"].load_state_dict(resumed["env_pool"])
        parts["controller"].version = resumed.get("weight_version", 0)
        if cfg.rollout.mode == "disaggregated":
            parts["controller"].load_state_dict(resumed.get("disaggregated"))
        start_step = resumed["rl_step"]
        rt.writer.rewind(start_step + 1)  # the steps after the checkpoint's are logged again
    if "critic" in parts:
        start_critic(parts, resumed)
    if cfg.algorithm.kl_coef > 0:  # reference = the policy RL started from (kept in host memory)
        if resumed is not None and resumed.get("reference") is None:
            raise ValueError(f"algorithm.kl_coef={cfg.algorithm.kl_coef}, but the checkpoint this run resumes from "
                             f"({parts['checkpoints'].root}) holds no usable reference policy (written with "
                             "kl_coef=0, or an older multi-rank checkpoint: see the warning above): resume with "
                             "algorithm.kl_coef=0, or start a new run (another run_dir)")
        parts["reference"] = parts["trainer"].snapshot_weights() if resumed is None else resumed["reference"]
    if cfg.algorithm.kl_in_reward:  # the penalty's coefficient, adaptive with algorithm.kl_target
        from megatron_rl.algorithms.kl import KLController

        algo = cfg.algorithm
        parts["kl_ctl"] = KLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
        if resumed is not None and resumed.get("kl_ctl") and algo.kl_target is not None:
            parts["kl_ctl"].load_state_dict(resumed["kl_ctl"])  # else: fixed, or switched on now: kl_coef
    show = rt.is_main and cfg.logging.progress
    # A step's number is the updates done once it ends: its metrics.jsonl row, log lines and checkpoint
    bar = tqdm(range(start_step + 1, cfg.num_steps + 1), desc="rl", unit="step", initial=start_step,
               total=cfg.num_steps, disable=not show)
    metrics: dict[str, float] = {}
    with logging_redirect_tqdm() if show else contextlib.nullcontext():
        for step in bar:
            start = time.perf_counter()
            metrics = rl_step(rt, parts, step - 1)  # which counts the steps before it
            every = cfg.algorithm.ref_update_every
            if every and "reference" in parts and step % every == 0:  # the KL anchor moves to the policy
                parts["reference"] = parts["trainer"].snapshot_weights()
            if (cfg.task.eval_every and step % cfg.task.eval_every == 0) or step == cfg.num_steps:
                metrics.update(evaluate(rt, parts, step=step))
            metrics["time/step"] = time.perf_counter() - start
            rt.writer.log(step, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            if step == 1 or step % cfg.logging.log_every == 0 or step == cfg.num_steps:
                logger.info(format_step_summary(step, metrics, SUMMARY))

            def state() -> dict:  # what a checkpoint holds besides model, optimizer and RNG
                return {"sampler": parts["sampler"].state_dict(), "rl_step": step,
                        "reference": parts.get("reference"), "weight_version": parts["controller"].version,
                        "domains": parts["domains"] and parts["domains"].state_dict(),
                        "env_pool": parts["env_pool"] and parts["env_pool"].state_dict(),
                        "kl_ctl": "kl_ctl" in parts and parts["kl_ctl"].state_dict(),
                        "disaggregated": cfg.rollout.mode == "disaggregated" and parts["controller"].state_dict()}

            parts["checkpoints"].after_step(step, state, metrics)
            if rt.preemption.stop_agreed(step, cfg.num_steps):
                rt.preemption.save_and_mark(parts["checkpoints"], step, state, metrics)
                break
    finish_rl(rt, parts)
    return metrics


def close_rl(rt, parts) -> None:
    parts["rewards"].close()
    if rt.cfg.rollout.mode == "disaggregated":
        parts["controller"].close()  # stops the generator processes


def finish_rl(rt, parts) -> None:
    from megatron_rl.observability import read_metrics
    from megatron_rl.observability.plots import plot_metrics
    from megatron_rl.observability.summary import rl_summary

    close_rl(rt, parts)
    if not rt.is_main:
        return
    rows = read_metrics(rt.run_dir / "metrics.jsonl")  # every step's, also those of a resumed run's earlier jobs
    plot_metrics(rt.run_dir / "metrics.jsonl", rt.run_dir / "plots", [k for k in PLOTS if any(k in r for r in rows)])
    summary = rl_summary(rows, rt.cfg.task.sft_warmup_steps)
    if summary:
        logger.info("%s; run directory %s", summary, rt.run_dir)


def main(argv: Sequence[str] | None = None) -> None:
    # torch only in a rank (runtime.start returned one): a bad config and the local launcher never load it (~2 s).
    rt = runtime.start(list(sys.argv[1:] if argv is None else argv), "megatron_rl.train", check=check_train_config)
    if rt is None:
        return
    import torch

    torch.set_num_threads(torch.get_num_threads())
    try:
        if rt.cfg.mode == "sft":
            from megatron_rl.sft import run_sft

            run_sft(rt)
        else:
            run_rl(rt)
    finally:
        runtime.finish(rt)


if __name__ == "__main__":
    main()
