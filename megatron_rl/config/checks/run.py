"""The RL (or SFT) run's cross-group checks: rollout vs model vs task vs algorithm, the rollout engine and
mode, routing replay, reward functions, replayed rollouts."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.checks import ConfigError


def check_sft_config(cfg) -> None:
    """`mode=sft`'s checks (megatron_rl.sft)."""
    if cfg.task.type == "dataset" and cfg.task.reward == "tests":
        raise ConfigError("task.reward=tests: SFT needs reference responses; give rows a "
                          f"{cfg.task.response_key!r} column and keep task.reward=auto")


def check_disaggregated_config(cfg) -> None:
    """Refuse settings disaggregated mode (megatron_rl.disagg) cannot run; colocated: checks that no
    disaggregated-only setting was changed."""
    r, algo = cfg.rollout, cfg.algorithm
    if r.mode != "disaggregated":
        if algo.max_staleness != 1:
            raise ConfigError(f"algorithm.max_staleness={algo.max_staleness} applies to rollout.mode=disaggregated "
                              "only: set rollout.mode=disaggregated or drop the override")
        return
    for key, value, off in (("oversample", r.oversample, 0.0), ("step_deadline_s", r.step_deadline_s, None)):
        if value != off:  # the buffer takes finished groups as they come; nothing waits for a step's stragglers
            raise ConfigError(f"rollout.{key}={value} is a colocated-mode setting (it cuts the stragglers of a "
                              f"step's rollout); with rollout.mode=disaggregated the experience buffer takes "
                              f"groups as they finish: drop the override")
    if r.stop and r.partial_rollout_tokens:
        raise ConfigError(f"rollout.stop={r.stop} with rollout.partial_rollout_tokens={r.partial_rollout_tokens}: "
                          "a stop string may span two chunks of a partial rollout, which stop strings are not "
                          "checked across; use stop token ids or partial_rollout_tokens=0")
    if algo.old_logprobs == "rollout":
        raise ConfigError(f"algorithm.old_logprobs={algo.old_logprobs} is invalid with rollout.mode=disaggregated: "
                          "stale rollouts need the trainer's log-probs (old_logprobs=recompute, current or auto) so "
                          "that the truncated-IS weight (algorithm.tis_cap) corrects the rollout/trainer mismatch")


def check_routing_replay(cfg) -> None:
    """algorithm.routing_replay's requirements, before any work starts."""
    mode = cfg.algorithm.routing_replay
    if mode == "none":
        return
    where = f"algorithm.routing_replay={mode}"
    if not cfg.model.is_moe:
        raise ConfigError(f"{where} replays a mixture of experts' routing, but the model (family "
                          f"{cfg.model.family}) has no experts: set algorithm.routing_replay=none")
    if mode == "old" and cfg.algorithm.old_logprobs != "recompute":
        raise ConfigError(f"{where} records the routing at the trainer's old-log-prob forward, which "
                          f"algorithm.old_logprobs={cfg.algorithm.old_logprobs} skips: use algorithm.old_logprobs="
                          "recompute, or algorithm.routing_replay=rollout (the engine's routing)")
    if cfg.model.recompute == "full" and cfg.parallel.pp > 1:
        raise ConfigError(f"{where} with model.recompute=full and parallel.pp={cfg.parallel.pp}: the 1F1B "
                          "schedule recomputes a layer's routing while another micro-batch is current; use "
                          "model.recompute=selective or none")


def check_run(cfg) -> None:
    """The run's cross-group checks for its mode (`mode=sft`: the supervised entry point's)."""
    if cfg.mode == "sft":
        return check_sft_config(cfg)
    _check_lengths_and_groups(cfg)
    from megatron_rl.rollout.factory import check_engine_config, job_shape

    check_engine_config(cfg, *job_shape(cfg))
    _check_reward_functions(cfg)
    _check_model_rewards(cfg)
    _check_agent_programs(cfg)
    _check_replay(cfg)
    check_disaggregated_config(cfg)
    check_routing_replay(cfg)
    if cfg.global_batch_size % cfg.rollout.n_samples_per_prompt:
        raise ConfigError(f"global_batch_size={cfg.global_batch_size} must be a multiple of "
                          f"rollout.n_samples_per_prompt={cfg.rollout.n_samples_per_prompt}")
    agents = {"task": cfg.task} if cfg.task.type == "agent" and not cfg.domains else {}
    agents.update({f"domains.{name}.task": d.task for name, d in cfg.domains.items() if d.task.type == "agent"})
    for where, task in agents.items():
        if task.max_episode_tokens > cfg.model.context_length:
            raise ConfigError(f"{where}.max_episode_tokens={task.max_episode_tokens} must be <= the model's context "
                              f"({cfg.model.context_length}: model.max_position_embeddings, or YaRN's scaled one)")
        if task.max_episode_tokens > cfg.micro_batch_tokens:  # an episode is one packed sample
            raise ConfigError(f"{where}.max_episode_tokens={task.max_episode_tokens} must be <= "
                              f"micro_batch_tokens={cfg.micro_batch_tokens} (a whole episode is packed in one "
                              "micro-batch row)")
    if cfg.parallel.cp > 1 and cfg.algorithm.policy_loss == "gspo":
        raise ConfigError(f"algorithm.policy_loss=gspo takes one importance ratio per sequence, a mean over all "
                          f"of its tokens, but parallel.cp={cfg.parallel.cp} splits every sequence over ranks: "
                          "use parallel.cp=1 or another policy loss")
    algo = cfg.algorithm
    if cfg.parallel.cp > 1 and (algo.rollout_is == "sequence" or algo.rollout_mask in ("sequence", "geometric")):
        key, value = (("rollout_is", algo.rollout_is) if algo.rollout_is == "sequence"
                      else ("rollout_mask", algo.rollout_mask))
        raise ConfigError(f"algorithm.{key}={value} weighs whole sequences, but parallel.cp={cfg.parallel.cp} "
                          "splits every sequence over ranks: use parallel.cp=1 or token-level correction")
    if cfg.domains and cfg.task.pool_refresh_every:
        raise ConfigError("task.pool_refresh_every > 0 is for single-task runs; set it to 0 with domains")
    if cfg.algorithm.overlong == "penalty" and cfg.algorithm.overlong_penalty_window > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_penalty_window={cfg.algorithm.overlong_penalty_window} must be <= "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")


def _check_agent_programs(cfg) -> None:
    """task.agent / task.agent_command: the function imports, the command's program exists, and the run uses
    no option the agent-program rollout (rollout/openai_episodes.py) does not implement."""
    import os
    import shutil

    tasks = {"task": cfg.task} if not cfg.domains else {f"domains.{n}.task": d.task for n, d in cfg.domains.items()}
    for where, task in tasks.items():
        if task.agent is None and task.agent_command is None:
            continue
        if cfg.domains:
            raise ConfigError(f"{where}: an agent program (task.agent / task.agent_command) plays a single-task run, "
                              "not a domain of a joint run")
        if task.agent is not None:
            from megatron_rl.envs.agent_program import load_agent_function

            try:
                load_agent_function(task.agent)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        else:
            program = task.agent_command[0]
            if shutil.which(program) is None and not os.path.isfile(program):
                raise ConfigError(f"task.agent_command={list(task.agent_command)}: {program!r} is neither on PATH "
                                  "nor a file")
        unsupported = {"rollout.mode": (cfg.rollout.mode, "colocated"),
                       "rollout.oversample": (cfg.rollout.oversample, 0.0),
                       "rollout.step_deadline_s": (cfg.rollout.step_deadline_s, None),
                       "task.sft_warmup_steps": (task.sft_warmup_steps, 0)}
        for key, (value, allowed) in unsupported.items():
            if value != allowed:
                raise ConfigError(f"{key}={value} is not implemented for an agent program's episodes "
                                  f"({where}.agent / agent_command): set {key}={allowed}")


def _check_reward_functions(cfg) -> None:
    """Import every `task.reward=package.module:function` now: a typo fails before any work starts."""
    from megatron_rl.rewards.custom import is_reward_path, load_reward_function

    tasks = {"task": cfg.task} if not cfg.domains else {f"domains.{n}.task": d.task for n, d in cfg.domains.items()}
    for where, task in tasks.items():
        if is_reward_path(task.reward):
            try:
                load_reward_function(task.reward)
            except ValueError as err:
                raise ConfigError(str(err).replace("task.reward", f"{where}.reward", 1)) from None


def _check_model_rewards(cfg) -> None:
    """Model rewards (task.reward=reward_model|judge) are computed by this job's trainer processes and engine."""
    tasks = {"task": cfg.task} if not cfg.domains else {f"domains.{n}.task": d.task for n, d in cfg.domains.items()}
    for where, task in tasks.items():
        if task.reward not in ("reward_model", "judge"):
            continue
        if cfg.rollout.mode == "disaggregated":
            raise ConfigError(f"{where}.reward={task.reward} with rollout.mode=disaggregated: model rewards are "
                              "computed by the trainer's processes and the colocated engine, not by generator "
                              "processes; use rollout.mode=colocated or a rule reward")
        if task.reward == "reward_model" and cfg.algorithm.dynamic_sampling:
            raise ConfigError(f"{where}.reward=reward_model with algorithm.dynamic_sampling=true: the reward model "
                              "scores a step's rollouts after generation, when the rounds of dynamic sampling are "
                              "over; set algorithm.dynamic_sampling=false (or use task.reward=judge, which scores "
                              "inside each round)")


def _check_replay(cfg) -> None:
    """rollout.replay_dir must hold dumps for the steps this run will take."""
    from megatron_rl.rollout.dump import dumped_steps

    where = cfg.rollout.replay_dir
    if where is None:
        return
    if cfg.rollout.mode == "disaggregated":
        raise ConfigError(f"rollout.replay_dir={where} replays rollouts in colocated mode: set "
                          "rollout.mode=colocated (the generators would have nothing to do)")
    steps = dumped_steps(where) if Path(where).is_dir() else []
    missing = sorted(set(range(1, cfg.num_steps + 1)) - set(steps))  # step k's dump: step_<k>.jsonl
    if missing:
        have = f"steps {steps[0]}..{steps[-1]}" if steps else "no step_<k>.jsonl files"
        raise ConfigError(f"rollout.replay_dir={where} has no rollouts of step {missing[0]} (it holds {have}): "
                          "point it at a run's rollouts/ directory written with logging.dump_rollouts=true, and "
                          "replay at most as many steps (num_steps)")


def _check_lengths_and_groups(cfg) -> None:
    algo, rollout = cfg.algorithm, cfg.rollout
    if algo.advantage_estimator in algo.GROUP_ESTIMATORS and rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            f"rollout.n_samples_per_prompt={rollout.n_samples_per_prompt} is invalid with "
            f"algorithm.advantage_estimator={algo.advantage_estimator}: group-relative advantages "
            "need >= 2 samples per prompt (all advantages would be 0)"
        )
    eval_tokens = cfg.task.eval_max_new_tokens
    context = cfg.model.context_length  # max_position_embeddings, or YaRN's scaled context
    if eval_tokens is not None and eval_tokens >= context:
        raise ConfigError(f"task.eval_max_new_tokens={eval_tokens} is invalid: must be < the model's context "
                          f"({context}: model.max_position_embeddings, or YaRN's scaled one) to leave room for the "
                          "prompt")
    if rollout.n_samples_per_prompt == 1 and (algo.filter_zero_variance or algo.dynamic_sampling):
        which = "filter_zero_variance" if algo.filter_zero_variance else "dynamic_sampling"
        raise ConfigError(f"algorithm.{which}=true with rollout.n_samples_per_prompt=1: every group of one sample "
                          "has no reward variance, so every sample would be dropped; sample >= 2 per prompt or "
                          f"set algorithm.{which}=false")
    if rollout.max_new_tokens >= context:
        raise ConfigError(
            f"rollout.max_new_tokens={rollout.max_new_tokens} is invalid: must be < the model's context ({context}: "
            "model.max_position_embeddings, or YaRN's scaled one) to leave room for the prompt"
        )
