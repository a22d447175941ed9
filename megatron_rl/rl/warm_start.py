"""The supervised warm start before RL (task.sft_warmup_steps): the task's reference answers, or for agent
tasks the reference episodes a scripted policy plays through their environments and the environment verifies;
a joint run takes both, each domain its own way. A stop signal checkpoints its progress, and a resumed job
continues it with the same batches."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from typing import Any, Optional

import torch

from megatron_rl.rollout.base import SamplingParams

logger = logging.getLogger(__name__)


def warm_start(rt, run: Any, stopped_at: Optional[dict] = None) -> bool:
    """Supervised steps on the task's reference answers (`task.sft_warmup_steps`); for agent
    tasks, on the verified reference episodes (`reference_episodes`); a joint run takes both,
    each domain its own way.

    A stop signal (megatron_rl.preemption) ends it after the current step with a checkpoint of its
    progress (RL step 0, meta.json "warm_start": steps done, its optimizer's state) and returns False;
    `stopped_at` (the `extra` of that checkpoint, already loaded with the optimizer `begin_warm_start`
    made) continues it there, with the same batches. True when the warm start is done."""
    from megatron_rl.sft import prompt_response_sample

    cfg = rt.cfg
    total = cfg.task.sft_warmup_steps
    done = stopped_at["warm_start"]["steps_done"] if stopped_at else 0
    if done >= total:
        return True
    trainer, tok, task = run.trainer, run.tokenizer, run.task
    if task.is_agent:
        samples = [e.sample({}) for e in reference_episodes(rt, run, run.train, cfg.task, run.rewards.verifier)]
    else:
        agents = getattr(task, "agent_domains", ())
        samples = [prompt_response_sample(tok, p.text, p.reference) for p in run.train
                   if p.meta.get("domain") not in agents]
        for name in agents:
            mine = [p for p in run.train if p.meta["domain"] == name]
            samples += [e.sample({}) for e in reference_episodes(rt, run, mine, task.tasks[name].cfg,
                                                                 run.rewards.verifier.verifiers[name], name)]
    generator = torch.Generator().manual_seed(cfg.seed)
    if stopped_at:
        generator.set_state(torch.frombuffer(bytearray(stopped_at["warm_start"]["batches"]), dtype=torch.uint8))
        logger.info("warm start: continuing after step %d of %d", done, total)
    else:
        begin_warm_start(rt, run)
    start = time.perf_counter()
    for step in range(done, total):
        index = torch.randint(len(samples), (cfg.global_batch_size,), generator=generator).tolist()
        metrics = trainer.train_step([samples[i] for i in index])
        if step % 50 == 0 or step == total - 1:
            logger.info("warm start %d/%d: loss %.3f", step + 1, total, metrics["loss"])
        if rt.preemption.stop_agreed(step + 1, total, what="warm-start step",
                                     save_seconds=run.checkpoints.longest_save_s):
            state = {"steps_done": step + 1, "batches": generator.get_state().numpy().tobytes()}
            run.checkpoints.save(0, {"warm_start": state}, meta={"warm_start": step + 1}, with_critic=False)
            rt.preemption.mark(0, run.checkpoints.root, warm_start_steps=step + 1)
            return False
    logger.info("warm start: %d supervised steps in %.0fs", total - done, time.perf_counter() - start)
    return True


def begin_warm_start(rt, run: Any, steps_done: int = 0) -> None:
    """The warm start's own optimizer and LR schedule (task.sft_warmup_lr over task.sft_warmup_steps, or
    over `steps_done` when a stopped warm start had done more than this run's config asks for)."""
    from megatron_rl.config.schema import OptimizerConfig

    total = max(rt.cfg.task.sft_warmup_steps, steps_done)
    run.trainer.reset_optimizer(OptimizerConfig(lr=rt.cfg.task.sft_warmup_lr), total)


def reference_episodes(rt, run: Any, prompts: list, task_cfg: Any, host: Any, domain: str = "") -> list:
    """The reference solutions of the agent tasks `prompts` (of the task `task_cfg`, whose
    environments `host.make_env` makes) played through their environments by a scripted policy
    (its environment's `reference_turns`; `repo`: write each reference file, submit), under the task's episode
    limits and `rollout.max_new_tokens` per turn, kept when the environment verifies them (full
    reward, task.reward_scale): episodes whose samples train the model's turns only, never the
    observations. Rank 0 plays them (one sandbox episode per task) and hands them to every rank."""
    from megatron_rl.envs import reference_turns
    from megatron_rl.rollout.multiturn import EpisodeLimits, run_episodes
    from megatron_rl.rollout.scripted import ScriptedPolicy

    payload: list[Any] = [None]
    what = f"domain {domain}" if domain else "task"
    if rt.is_main:
        tasks = [p.meta for p in prompts if p.meta.get("reference")]
        if not tasks:
            raise ValueError(f"task.sft_warmup_steps > 0 on agent tasks needs tasks with a `reference` solution; "
                             f"the {what}'s have none: set task.sft_warmup_steps=0")
        fmt = run.generation.turn_format(task_cfg)
        params = SamplingParams(max_new_tokens=rt.cfg.rollout.max_new_tokens)

        def play(task: dict) -> list:  # one scripted policy per task: instructions need not be unique
            policy = ScriptedPolicy(run.tokenizer, reference_turns(task_cfg.environment, task),
                                    end_of_turn=fmt.end_of_turn)
            return run_episodes(policy, [task], 1, params, host.make_env, fmt, EpisodeLimits.of(task_cfg),
                                run.rewards.loop)

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # the sandbox's own limits bound the load
            episodes = [e for found in pool.map(play, tasks) for e in found]
        verified = [e for e in episodes if e.reward >= task_cfg.reward_scale]
        counts = collections.Counter(e.status for e in episodes)
        ends = ", ".join(f"{status} {n}" for status, n in sorted(counts.items()))
        logger.info("warm start: %d of %d reference episodes verified%s (episode ends: %s; %.0fs)", len(verified),
                    len(tasks), f" in domain {domain}" if domain else "", ends, time.perf_counter() - start)
        if not verified:
            raise RuntimeError(f"no reference episode of the {what} was verified (episode ends: {ends}): check "
                               "task.max_turns, task.max_episode_tokens and rollout.max_new_tokens against the "
                               "reference solutions, and `python -m megatron_rl.quality` on the task set")
        payload = [verified]
    if rt.groups.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(payload, src=0)
    return payload[0]
