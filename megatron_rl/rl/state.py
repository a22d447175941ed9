"""`RunState`: everything one RL run holds, typed, with one `state_dict` / `load_state_dict` for exact
resume (what a checkpoint keeps besides model, optimizer and RNG states); `build_run` makes it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

from megatron_rl import runtime

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunState:
    cfg: Any
    tokenizer: Any
    task: Any  # a MultiTask over cfg.domains when set
    trainer: Any  # the policy
    controller: Any  # the colocation controller: engine and trainer time-sharing (evaluation's rollouts too)
    generation: Any  # rollout.colocated.Generation: generating on this job's engine
    source: Any  # rollout.source.RolloutSource: a step's rollouts (colocated, disaggregated or replay)
    rewards: Any  # rewards.service.RewardService
    loss_fn: Callable
    train: list  # training prompts
    eval: list  # held-out prompts
    sampler: Any
    checkpoints: Any
    writer: Any  # the metrics sink (observability.MetricsWriter: metrics.jsonl, TensorBoard)
    domains: Any = None  # rl_domains.JointTraining of a multi-domain run
    env_pool: Any = None  # data.env_pool.EnvPool (task.pool_size)
    critic: Any = None  # algorithm.critic: the value model
    value_loss_fn: Optional[Callable] = None
    kl_ctl: Any = None  # algorithm.kl_in_reward: the penalty's (adaptive) coefficient
    reference: Optional[dict] = None  # algorithm.kl_coef > 0: the reference policy's weights, in host memory
    reward_models: Optional[dict] = None  # task.reward=reward_model: checkpoint path -> rl.reward_model.RewardModel
    teacher: Any = None  # algorithm.distill.teacher: trainer.teacher.Teacher, frozen, in host memory between forwards

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint after `step` updates holds besides model, optimizer and RNG."""
        return {"sampler": self.sampler.state_dict(), "rl_step": step, "reference": self.reference,
                "domains": self.domains and self.domains.state_dict(),
                "env_pool": self.env_pool and self.env_pool.state_dict(),
                "kl_ctl": self.kl_ctl is not None and self.kl_ctl.state_dict(), **self.source.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's `state_dict`. A piece switched on since the checkpoint was written starts
        fresh (an environment pool, an adaptive KL coefficient); a reference policy it lacks is an error."""
        self.sampler.load_state_dict(state["sampler"])
        if self.domains:
            self.domains.load_state_dict(state.get("domains"))
        if self.env_pool and state.get("env_pool"):
            self.env_pool.load_state_dict(state["env_pool"])
        self.source.load_state_dict(state)
        algo = self.cfg.algorithm
        if self.kl_ctl is not None and state.get("kl_ctl") and algo.kl_target is not None:
            self.kl_ctl.load_state_dict(state["kl_ctl"])  # else: fixed, or switched on now: kl_coef
        if algo.kl_coef > 0:
            if state.get("reference") is None:
                raise ValueError(f"algorithm.kl_coef={algo.kl_coef}, but the checkpoint this run resumes from "
                                 f"({self.checkpoints.root}) holds no usable reference policy (written with "
                                 "kl_coef=0, or an older multi-rank checkpoint: see the warning above): resume with "
                                 "algorithm.kl_coef=0, or start a new run (another run_dir)")
            self.reference = state["reference"]

    def close(self) -> None:
        self.rewards.close()
        self.source.close()  # a disaggregated source stops its generator processes


def build_run(rt, evaluation: bool = False) -> RunState:
    """Everything one RL run holds: tokenizer, task, trainer, engine, controller, rollout source, rewards (and,
    with algorithm.critic, the critic; with algorithm.kl_in_reward, the KL controller; with
    algorithm.distill.teacher, the teacher).

    `evaluation` (offline evaluation of checkpoints, rl/evaluate.py): no critic, and the rollouts come from
    this job's own engine, also for a disaggregated run's config (no generators start). A disaggregated
    training run uses its own engine only to evaluate: without held-out prompts it builds none."""
    from megatron_rl.algorithms.objective import make_policy_loss_fn, make_value_loss_fn
    from megatron_rl.checkpoint.manager import CheckpointManager
    from megatron_rl.colocate.controller import ColocationController
    from megatron_rl.data.domains import make_sampler, make_task
    from megatron_rl.data.env_pool import make_env_pool
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rewards.service import RewardService
    from megatron_rl.rl.model_rewards import build_reward_models
    from megatron_rl.rl_domains import make_joint
    from megatron_rl.rollout.colocated import ColocatedSource, Generation
    from megatron_rl.rollout.factory import make_engine
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    cfg = rt.cfg
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code)
    task = make_task(cfg, tokenizer)
    options = TrainerOptions(
        micro_batch_tokens=cfg.micro_batch_tokens, use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce, overlap_param_gather=cfg.parallel.overlap_param_gather,
        deterministic=cfg.deterministic,
        total_steps=cfg.num_steps * cfg.algorithm.num_inner_updates, pad_token_id=tokenizer.pad_token_id,
        logprob_temperature=cfg.rollout.temperature or 1.0,  # 0 (greedy): log-probs at temperature 1
        routing_replay=cfg.algorithm.routing_replay != "none")
    trainer = Trainer(cfg.model, cfg.optimizer, rt.groups, options)
    teacher = None
    if cfg.algorithm.distill.teacher and not evaluation:  # offloaded once loaded: before the engine sizes its KV cache
        from megatron_rl.config.teacher import teacher_model_config
        from megatron_rl.trainer.teacher import Teacher

        teacher = Teacher(teacher_model_config(cfg.model, cfg.algorithm.distill.teacher), cfg.optimizer, rt.groups,
                          options)
        spec = cfg.algorithm.distill
        if spec.estimator == "topk" and rt.is_main:  # what the teacher's top k cost in host memory, said up front
            per_token = 12 * spec.topk
            responses = cfg.global_batch_size * cfg.rollout.max_new_tokens * per_token
            logger.info("top-k distillation keeps the teacher's %d likeliest tokens at every position of every sample "
                        "(prompts included): %d bytes per token in host memory on every rank, %.1f MB for a step's "
                        "responses alone (%d samples x up to %d tokens)", spec.topk, per_token, responses / 1e6,
                        cfg.global_batch_size, cfg.rollout.max_new_tokens)
    # PPO's value model: the policy's architecture with a value head, its weights copied from the policy
    # once RL starts (`rl.loop.start_critic`)
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
    # reward models: built at the policy's layout once the engine has sized its memory, then kept off the
    # accelerator except while they score
    reward_models = build_reward_models(cfg, task, rt.groups, options)
    controller = ColocationController(trainer, engine, critic=critic, weight_sync=cfg.rollout.weight_sync,
                                      bucket_bytes=max(1, int(cfg.rollout.weight_sync_bucket_mb * 2**20)))
    controller.log_memory_plan()
    addresses = runtime.sandbox_addresses(rt) if task.needs_sandbox else []
    rewards = RewardService(task.verifier_factory(addresses))
    check_sample_budget(cfg, train_prompts, teacher.model_cfg.context_length if teacher is not None else None)
    sampler = make_sampler(task, train_prompts, cfg.seed)
    generation = Generation(cfg, rt.groups, engine, task, tokenizer, rewards, controller)
    source: Any
    if cfg.rollout.replay_dir is not None:  # debugging: a dumped run's samples, nothing generated
        from megatron_rl.rollout.dump import ReplaySource

        source = ReplaySource(cfg.rollout.replay_dir, controller)
    elif disaggregated:  # generator processes + experience buffer; evaluation stays colocated
        from megatron_rl.disagg.controller import DisaggregatedController

        source = DisaggregatedController(rt, controller, task, train_prompts, sampler, addresses)
    else:
        source = ColocatedSource(generation, sampler, train_prompts)
    checkpoints = CheckpointManager(cfg.checkpoint, rt.run_dir, trainer, cfg, cfg.num_steps, tokenizer)
    checkpoints.critic = critic
    kl_ctl = None
    if cfg.algorithm.kl_in_reward and not evaluation:  # the penalty's coefficient, adaptive with algorithm.kl_target
        from megatron_rl.algorithms.kl import KLController

        kl_ctl = KLController(cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon)
    return RunState(cfg=cfg, tokenizer=tokenizer, task=task, trainer=trainer, controller=controller,
                    generation=generation, source=source, rewards=rewards,
                    loss_fn=make_policy_loss_fn(cfg.algorithm), train=train_prompts, eval=eval_prompts,
                    sampler=sampler, checkpoints=checkpoints, writer=rt.writer,
                    domains=make_joint(cfg, task, sampler), env_pool=make_env_pool(cfg, task, train_prompts),
                    critic=critic, value_loss_fn=make_value_loss_fn(cfg.algorithm.value_clip) if critic else None,
                    kl_ctl=kl_ctl, reward_models=reward_models, teacher=teacher)


def critic_optimizer(cfg):
    """The critic's optimizer settings: optimizer.*, with algorithm.critic_lr (and min_lr at most that)."""
    return dataclasses.replace(cfg.optimizer, lr=cfg.algorithm.critic_lr,
                               min_lr=min(cfg.optimizer.min_lr, cfg.algorithm.critic_lr))


def check_sample_budget(cfg, prompts, teacher_context: Optional[int] = None) -> None:
    """The longest single-turn prompt plus a full response must fit one micro-batch row and the model's positions
    (`ModelConfig.context_length`, the longest sequence it is built for: past it nothing fails, RoPE runs on
    positions never trained), and a distillation teacher's (`teacher_context`, its context_length: it scores every
    sample): found now, before any generation, rather than when the first batch is packed (ValueError with the
    fix)."""
    longest = max((len(p.tokens) for p in prompts), default=0)  # agent prompts carry no tokens here
    reach = longest + cfg.rollout.max_new_tokens
    for key, limit, fix in (("the model's context (model.max_position_embeddings, or YaRN's scaled one)",
                             cfg.model.context_length, "lower rollout.max_new_tokens"),
                            ("micro_batch_tokens", cfg.micro_batch_tokens, "raise micro_batch_tokens"),
                            ("the distillation teacher's context (its max_position_embeddings, or YaRN's scaled one)",
                             teacher_context, "lower rollout.max_new_tokens")):
        if longest and limit is not None and reach > limit:
            raise ValueError(f"the longest training prompt has {longest} tokens; with rollout.max_new_tokens="
                             f"{cfg.rollout.max_new_tokens} a sample can reach {reach} tokens, more than "
                             f"{key}={limit}: "
                             f"{fix} or leave long prompts out (task.max_prompt_tokens)")
