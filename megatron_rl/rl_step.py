"""The phases of one RL step, the warm start and evaluation, called from `train.py`.

rl_step: sample prompts -> colocated rollout (sync + generate, rewards computed as chunks
finish; with dynamic sampling, more rounds until enough groups carry a signal; or, with
rollout.mode=disaggregated, publish weights and take groups from the experience buffer) -> reward
shaping (overlong penalty) -> group advantages -> sample filters (zero-variance groups,
overlong responses) -> old log-probs (recomputed or the engine's) -> policy update(s).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, Optional, Sequence

import torch

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.evaluation.records import eval_metrics, records_from_rollouts
from megatron_rl.rollout.collect import Rollout, collect, is_scored, uncovered_routing

logger = logging.getLogger(__name__)


def _decode(tokenizer):
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)
    return decode


def _reward_wait(cfg) -> float:
    """How long the collector waits for a chunk's rewards: 300 s, or longer when a reward function
    may take longer per call (task.reward_timeout_s)."""
    tasks = [d.task for d in cfg.domains.values()] if cfg.domains else [cfg.task]
    return max(300.0, *(2 * t.reward_timeout_s for t in tasks))


def _sampling(cfg, parts: dict, n: int, seed: int, evaluation: bool = False) -> SamplingParams:
    """Training's sampling settings (rollout.*), or evaluation's: task.eval_* where set."""
    r, t = cfg.rollout, cfg.task

    def pick(own: Any, default: Any) -> Any:
        return default if own is None or not evaluation else own
    return SamplingParams(temperature=pick(t.eval_temperature, r.temperature), top_p=pick(t.eval_top_p, r.top_p),
                          top_k=pick(t.eval_top_k, r.top_k),
                          max_new_tokens=pick(t.eval_max_new_tokens, r.max_new_tokens), n=n, seed=seed,
                          stop_token_ids=parts["task"].stop_token_ids, stop=tuple(r.stop),
                          return_routing=cfg.algorithm.routing_replay == "rollout" and not evaluation)


def warm_start(rt, parts: dict, stopped_at: Optional[dict] = None) -> bool:
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
    trainer, tok, task = parts["trainer"], parts["tokenizer"], parts["task"]
    if task.is_agent:
        samples = [e.sample({}) for e in reference_episodes(rt, parts, parts["train"], cfg.task,
                                                            parts["rewards"].verifier)]
    else:
        agents = getattr(task, "agent_domains", ())
        samples = [prompt_response_sample(tok, p.text, p.reference) for p in parts["train"]
                   if p.meta.get("domain") not in agents]
        for name in agents:
            mine = [p for p in parts["train"] if p.meta["domain"] == name]
            samples += [e.sample({}) for e in reference_episodes(rt, parts, mine, task.tasks[name].cfg,
                                                                 parts["rewards"].verifier.verifiers[name], name)]
    generator = torch.Generator().manual_seed(cfg.seed)
    if stopped_at:
        generator.set_state(torch.frombuffer(bytearray(stopped_at["warm_start"]["batches"]), dtype=torch.uint8))
        logger.info("warm start: continuing after step %d of %d", done, total)
    else:
        begin_warm_start(rt, parts)
    start = time.perf_counter()
    for step in range(done, total):
        index = torch.randint(len(samples), (cfg.global_batch_size,), generator=generator).tolist()
        metrics = trainer.train_step([samples[i] for i in index])
        if step % 50 == 0 or step == total - 1:
            logger.info("warm start %d/%d: loss %.3f", step + 1, total, metrics["loss"])
        if rt.preemption.stop_agreed(step + 1, total, what="warm-start step"):
            state = {"steps_done": step + 1, "batches": generator.get_state().numpy().tobytes()}
            parts["checkpoints"].save(0, {"warm_start": state}, meta={"warm_start": step + 1}, with_critic=False)
            rt.preemption.mark(0, parts["checkpoints"].root, warm_start_steps=step + 1)
            return False
    logger.info("warm start: %d supervised steps in %.0fs", total - done, time.perf_counter() - start)
    return True


def begin_warm_start(rt, parts: dict, steps_done: int = 0) -> None:
    """The warm start's own optimizer and LR schedule (task.sft_warmup_lr over task.sft_warmup_steps, or
    over `steps_done` when a stopped warm start had done more than this run's config asks for)."""
    from megatron_rl.config.schema import OptimizerConfig

    total = max(rt.cfg.task.sft_warmup_steps, steps_done)
    parts["trainer"].reset_optimizer(OptimizerConfig(lr=rt.cfg.task.sft_warmup_lr), total)


def reference_episodes(rt, parts: dict, prompts: list, task_cfg: Any, host: Any, domain: str = "") -> list:
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
        fmt = _turn_format(parts, task_cfg)
        params = SamplingParams(max_new_tokens=rt.cfg.rollout.max_new_tokens)

        def play(task: dict) -> list:  # one scripted policy per task: instructions need not be unique
            policy = ScriptedPolicy(parts["tokenizer"], reference_turns(task_cfg.environment, task),
                                    end_of_turn=fmt.end_of_turn)
            return run_episodes(policy, [task], 1, params, host.make_env, fmt, EpisodeLimits.of(task_cfg),
                                parts["rewards"].loop)

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


def _turn_format(parts: dict, task_cfg: Any):
    """The agent task's chat-template pieces (one per system prompt, kept in `parts`)."""
    from megatron_rl.rollout.multiturn import TurnFormat, task_system_prompt

    formats = parts.setdefault("turn_formats", {})
    system = task_system_prompt(task_cfg)
    if system not in formats:
        formats[system] = TurnFormat(parts["tokenizer"], system)
    return formats[system]


@dataclasses.dataclass
class _DomainRewards:
    """What `collect_episodes` needs of the reward service, for one agent domain of a joint run."""

    verifier: Any  # the domain's environment host
    loop: Any


def _generate(rt, parts: dict, prompts: list, params: SamplingParams,
              training: bool = False) -> tuple[list[Rollout], dict[str, float]]:
    """Completions and rewards: one per sample, or whole multi-turn episodes for agent tasks;
    a joint run with agent domains does both (`_generate_domains`). Only a training step's
    rollouts (`training`) are over-sampled and cut at the step deadline: evaluation plays every
    prompt to its end."""
    task = parts["task"]
    if getattr(task, "agent_domains", ()):
        return _generate_domains(rt, parts, prompts, params, training)
    if not task.is_agent:
        return collect(parts["engine"], prompts, params, parts["rewards"], rt.groups, _decode(parts["tokenizer"]),
                       num_chunks=rt.cfg.rollout.generate_chunks, reward_timeout_s=_reward_wait(rt.cfg))
    return _episodes(rt, parts, prompts, params, task.cfg, parts["rewards"], training)


def _episodes(rt, parts: dict, prompts: list, params: SamplingParams, task_cfg: Any, rewards: Any,
              training: bool, target: Optional[int] = None) -> tuple[list[Rollout], dict[str, float]]:
    """Agent task `task_cfg`'s prompts played as episodes (its turn format and episode limits).
    In a training step with over-sampling, the groups beyond the first `target` done are cut
    (default: the batch's groups, global_batch_size / n), and episodes stop at the step deadline."""
    from megatron_rl.rollout.episodes import collect_episodes
    from megatron_rl.rollout.multiturn import EpisodeLimits

    r = rt.cfg.rollout
    if not training:
        target = None
    elif r.oversample and target is None:
        target = rt.cfg.global_batch_size // params.n
    got, stats = collect_episodes(parts["engine"], prompts, params, rewards, rt.groups,
                                  _turn_format(parts, task_cfg), EpisodeLimits.of(task_cfg), r.agent_scheduler,
                                  r.max_concurrent_episodes, target, parts["controller"].timeline,
                                  r.step_deadline_s if training else None, r.straggler_policy == "partial")
    if target is not None:
        _cut_beyond(got, target)
    return got, stats


def _generate_domains(rt, parts: dict, prompts: list, params: SamplingParams,
                      training: bool) -> tuple[list[Rollout], dict[str, float]]:
    """A joint run with agent domains: the single-turn domains' prompts in one `collect`, then
    each agent domain's episodes with its own environments, turn format and episode limits, one
    after the other on the same engine (every rank runs the same sequence: both paths hold
    collectives). Rollouts come back in prompt order; an agent domain's episode metrics are
    logged under `domain/<name>/`, time spent is summed.

    In a training step with over-sampling (rollout.oversample) the batch's groups are shared out over the parts in
    proportion to their prompts (`apportion`), so that the mixture keeps its weights: an agent
    domain cuts its groups beyond its share, the single-turn part, whose groups all finish,
    generates only its share (the rest of its prompts are skipped, like cut ones)."""
    task, rewards = parts["task"], parts["rewards"]
    agents = task.agent_domains
    shares: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        domain = p.meta["domain"]
        shares.setdefault(domain if domain in agents else "", []).append(i)
    targets: dict[str, int] = {}
    if training and rt.cfg.rollout.oversample:
        batch_groups = rt.cfg.global_batch_size // params.n
        targets = dict(zip(shares, apportion([len(index) for index in shares.values()], batch_groups)))
    out: list[Rollout] = []
    timing: dict[str, float] = {}
    for domain, index in shares.items():
        if targets and not targets[domain]:  # no share of this batch (every rank skips it alike)
            continue
        if not domain and targets:
            index = index[:targets[domain]]
        mine = [prompts[i] for i in index]
        if not domain:
            got, stats = collect(parts["engine"], mine, params, rewards, rt.groups, _decode(parts["tokenizer"]),
                                 num_chunks=rt.cfg.rollout.generate_chunks, reward_timeout_s=_reward_wait(rt.cfg))
        else:
            view = _DomainRewards(rewards.verifier.verifiers[domain], rewards.loop)
            got, stats = _episodes(rt, parts, mine, params, task.tasks[domain].cfg, view, training, targets.get(domain))
            stats = {(k if k.startswith("time/") else f"domain/{domain}/{k}"): v for k, v in stats.items()}
        for r in got:
            r.prompt_index = index[r.prompt_index]
            r.domain = prompts[r.prompt_index].meta["domain"]
        out += got
        for key, value in stats.items():
            timing[key] = timing.get(key, 0.0) + value
    out.sort(key=lambda r: r.prompt_index)  # stable: a group's samples keep their order
    return out, timing


def _cut_beyond(rollouts: list[Rollout], target: int) -> None:
    """Cut the groups beyond the first `target` (in prompt order) that were neither cut nor stopped
    at the deadline: groups that finished together with the one that filled the share (in the same
    turn of the event loop, or on another data-parallel rank, whose share is rounded up), or that
    `straggler_policy=partial` kept, so that the batch (or a domain's share of it) is exact and
    every group generated beyond it is counted as cut."""
    lost = {r.prompt_index for r in rollouts if r.status in ("aborted", "deadline")}
    extra = set(sorted({r.prompt_index for r in rollouts} - lost)[target:])
    for r in rollouts:
        if r.prompt_index in extra:
            r.status, r.reward = "aborted", 0.0


def apportion(sizes: list[int], total: int) -> list[int]:
    """Split `total` over parts of these sizes in proportion to them (largest remainders; no part
    gets more than its size; the shares sum to min(total, sum(sizes)))."""
    whole = sum(sizes)
    total = min(total, whole)
    if not whole:
        return [0] * len(sizes)
    exact = [size * total / whole for size in sizes]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda k: (-(exact[k] - shares[k]), k))
    for k in by_remainder[:total - sum(shares)]:
        shares[k] += 1
    return shares


def scored_rewards(cfg, group: Sequence[Rollout]) -> torch.Tensor:
    """The shaped rewards of a group's scored samples (what dynamic sampling judges a group by)."""
    return shaped_rewards(cfg, [r for r in group if is_scored(r)])


def _model_tokens(rollout: Rollout) -> list[int]:
    """1 on the response tokens the policy wrote (an episode's tool output is 0)."""
    return list(getattr(rollout, "model_mask", None) or [1] * len(rollout.output_ids))


def token_advantages(algo, rewards: torch.Tensor, rollouts: list[Rollout],
                     penalties: Optional[list[torch.Tensor]] = None, values: Optional[list[torch.Tensor]] = None
                     ) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
    """Per response token advantages [len(output_ids)] of each rollout, from rewards [N] of the SCORED
    rollouts given (lost ones must be left out by the caller). Group estimators broadcast one value per
    sample (reinforce_pp whitens over the batch's model tokens: each sample weighs its number of model
    tokens); gae puts each reward on the sample's last model token and runs the recursion over the model
    tokens with algorithm.gae_gamma / gae_lambda and the critic's `values` (per rollout [len(output_ids)];
    None: no critic, values 0), whitened over the batch.
    penalties (algorithm.kl_in_reward): per rollout, what each response token's reward loses [len(output_ids)];
    a group estimator sees the reward minus the sample's summed penalty, gae the per-token rewards.
    Returns (advantages, GAE's returns R_t = A_t + V_t before whitening: the critic's targets, when `values`
    are given; else None)."""
    from megatron_rl.algorithms.advantages import gae, place_sequence_rewards
    from megatron_rl.algorithms.registry import ADVANTAGE_ESTIMATORS

    if not rollouts:  # every sample lost: nothing to estimate
        return [], None if values is None else []
    if algo.advantage_estimator != "gae":
        if penalties is not None:
            rewards = rewards - torch.stack([p.sum() for p in penalties]).to(rewards.dtype)
        group_ids = torch.tensor([r.prompt_index for r in rollouts], dtype=torch.long)
        options: dict[str, torch.Tensor] = {}
        if algo.advantage_estimator == "reinforce_pp":  # whitened over the model's tokens, as verl and OpenRLHF do
            options["token_counts"] = torch.tensor([float(sum(_model_tokens(r))) for r in rollouts])
        per_sample = ADVANTAGE_ESTIMATORS.get(algo.advantage_estimator)(rewards, group_ids, **options)
        return [torch.full((len(r.output_ids),), float(a)) for r, a in zip(rollouts, per_sample)], None
    width = max((len(r.output_ids) for r in rollouts), default=0)
    mask = torch.zeros(len(rollouts), width)
    for i, r in enumerate(rollouts):
        mask[i, :len(r.output_ids)] = torch.tensor(_model_tokens(r), dtype=torch.float)
    token_rewards = place_sequence_rewards(rewards, mask)
    if penalties is not None:
        for i, p in enumerate(penalties):
            token_rewards[i, :len(p)] -= p.to(token_rewards.dtype)
    value_grid = None
    if values is not None:
        value_grid = torch.zeros_like(mask)
        for i, v in enumerate(values):
            value_grid[i, :len(v)] = v.to(value_grid.dtype)
    grid, returns = gae(token_rewards, mask, value_grid, algo.gae_gamma, algo.gae_lambda)
    per_rollout = [grid[i, :len(r.output_ids)].clone() for i, r in enumerate(rollouts)]
    if values is None:
        return per_rollout, None
    return per_rollout, [returns[i, :len(r.output_ids)].clone() for i, r in enumerate(rollouts)]


def shaped_rewards(cfg, rollouts: list[Rollout]) -> torch.Tensor:
    """Verifier rewards plus the overlong penalty (algorithm.overlong=penalty), per sample. The overlong
    shaping and filter judge single-turn responses against rollout.max_new_tokens; an agent episode
    (tool output among its tokens, max_new_tokens a per-turn limit) is bounded by task.max_episode_tokens
    instead and left as it is."""
    from megatron_rl.algorithms.filters import overlong

    rewards = torch.tensor([r.reward for r in rollouts])
    if cfg.algorithm.overlong != "penalty":
        return rewards
    lengths = torch.tensor([float(len(r.output_ids)) for r in rollouts])
    _, adjustment = overlong(lengths, cfg.rollout.max_new_tokens, "penalty", cfg.algorithm.overlong_penalty_window,
                             cfg.algorithm.overlong_penalty)
    single = torch.tensor([not hasattr(r, "model_mask") for r in rollouts], dtype=adjustment.dtype)
    return rewards + adjustment * single


_EPISODE_STATUSES = ("submitted", "max_turns", "max_tokens", "wall_time", "dropped", "aborted", "deadline", "partial")


def _episode_mean_prefix(key: str) -> Optional[str]:
    """The prefix ("" or "domain/<d>/") of an episode mean (`agent/turns_mean`, `agent/env/...`), else None."""
    for marker in ("agent/turns_mean", "agent/env/"):
        at = key.find(marker)
        if at >= 0 and (at == 0 or key[:at].startswith("domain/")):
            return key[:at]
    return None


def combine_rounds(per_round: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's generation metrics from its dynamic-sampling rounds: times and counts add up; the
    episode means (`agent/turns_mean`, `agent/env/...`, also a joint run's `domain/<d>/...`) are
    weighted by each round's episodes (its `agent/<status>` counts); `sched/engine_busy` by each round's
    `sched/wall_s`, the fraction of all the rounds' wall time the engine was busy. (Summing them, as
    before, reported 2 for an engine busy throughout two rounds.)"""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for stats in per_round:
        for key, value in stats.items():
            weight = 1.0
            if key.endswith("sched/engine_busy"):
                weight = stats.get(key[:-len("engine_busy")] + "wall_s", 0.0)
            elif (prefix := _episode_mean_prefix(key)) is not None:
                weight = sum(stats.get(f"{prefix}agent/{s}", 0.0) for s in _EPISODE_STATUSES)
            sums[key] = sums.get(key, 0.0) + value * weight
            weights[key] = weights.get(key, 0.0) + weight
    return {key: (total / max(weights[key], 1e-9) if key.endswith("sched/engine_busy")
                  or _episode_mean_prefix(key) is not None else total)
            for key, total in sums.items()}


def generate_groups(rt, parts: dict, step: int) -> tuple[list[Rollout], dict[str, float]]:
    """The step's rollouts, group ids unique across rounds. One round of global_batch_size / n
    prompts; with dynamic sampling, rounds repeat (inside one weight sync) until that many
    groups have reward variance or the round limit is hit."""
    from megatron_rl.algorithms.filters import DynamicSampler, has_reward_variance

    cfg, algo = rt.cfg, rt.cfg.algorithm
    n = cfg.rollout.n_samples_per_prompt
    num_groups = cfg.global_batch_size // n
    drawn = num_groups + round(num_groups * cfg.rollout.oversample)  # async agent rollouts cut the extra ones
    rounds = DynamicSampler(num_groups, algo.dynamic_sampling_max_rounds if algo.dynamic_sampling else 1,
                            has_reward_variance if algo.dynamic_sampling else (lambda rewards: True))

    def run() -> dict[str, float]:
        timing: dict[str, float] = {}
        per_round: list[dict[str, float]] = []
        while not rounds.done:
            indices = parts["sampler"].next_batch(drawn)
            prompts = [parts["train"][i] for i in indices]
            params = _sampling(cfg, parts, n, seed=cfg.seed * 100_003 + step + 7919 * rounds.num_rounds)
            got, timing_round = _generate(rt, parts, prompts, params, training=True)
            for r in got:
                r.source_index = indices[r.prompt_index]
            per_round.append(timing_round)
            by_prompt: dict[int, list[Rollout]] = {}  # a joint run may skip prompts (_generate_domains)
            for r in got:
                by_prompt.setdefault(r.prompt_index, []).append(r)
            groups = [by_prompt[g] for g in sorted(by_prompt)]
            cut = [any(getattr(r, "status", "") == "aborted" for r in group) for group in groups]
            if cfg.rollout.oversample:
                timing["sched/groups_cut"] = timing.get("sched/groups_cut", 0.0) + sum(cut)
            groups = [group for group, was_cut in zip(groups, cut) if not was_cut]
            rounds.add_round(groups, [scored_rewards(cfg, group) for group in groups])
        return {**combine_rounds(per_round), **timing}

    timing, kept = parts["controller"].rollout(run), rounds.batch()
    if algo.dynamic_sampling:
        timing.update({f"dynamic_sampling/{k}": v for k, v in rounds.stats().items()})
        if rounds.exhausted:
            logger.warning("step %d: dynamic sampling kept %d/%d groups in %d rounds; training on the short batch",
                           step + 1, rounds.num_kept, num_groups, rounds.num_rounds)
    rollouts = [dataclasses.replace(r, prompt_index=g) for g, group in enumerate(kept) for r in group]
    return rollouts, timing


def step_advantages(cfg, rollouts: list[Rollout], rewards: torch.Tensor, joint: Any = None,
                    penalties: Optional[list[Optional[torch.Tensor]]] = None,
                    values: Optional[list[Optional[torch.Tensor]]] = None
                    ) -> tuple[list[Optional[torch.Tensor]], Optional[list[Optional[torch.Tensor]]]]:
    """Per response token advantages of each rollout (None for a lost one) from the shaped rewards [N]
    and, with algorithm.kl_in_reward, each scored rollout's per-token KL penalties (`reward_kl`); with a
    critic, its per-token `values` (`critic_values`) and then also the returns (its targets; else None).
    Lost episodes take no part in group baselines or in a joint run's per-domain calibration (a joint run's
    `advantage_rewards` sees the scored rewards only; the KL penalty applies after the calibration)."""
    scored = [r for r in rollouts if is_scored(r)]
    scored_rewards = rewards[torch.tensor([is_scored(r) for r in rollouts], dtype=torch.bool)]
    if joint is not None:
        scored_rewards = joint.advantage_rewards(scored_rewards, scored)

    def of_scored(per_rollout: Optional[list]) -> Optional[list]:
        return None if per_rollout is None else [x for r, x in zip(rollouts, per_rollout) if is_scored(r)]

    advantages, returns = token_advantages(cfg.algorithm, scored_rewards, scored, of_scored(penalties),
                                           of_scored(values))

    def spread(per_scored: Optional[list]) -> Optional[list]:
        if per_scored is None:
            return None
        found = iter(per_scored)
        return [next(found) if is_scored(r) else None for r in rollouts]
    return spread(advantages), spread(returns)  # type: ignore[return-value]


def reward_kl(cfg, parts: dict, rollouts: list[Rollout]) -> tuple[list[Optional[dict]], dict[str, float]]:
    """algorithm.kl_in_reward: for each scored rollout (None for a lost one) its log-probs before the update
    and the reference's ("old_logprobs", "ref_logprobs": the update reuses them) and its "penalty", kl_coef
    times the KL estimate on each response token (0 on tool output). Then the KL controller
    (`parts["kl_ctl"]`) adapts kl_coef to this step's KL: the mean over samples of each sample's mean KL
    per model token."""
    from megatron_rl.algorithms.kl import kl_estimate

    ctl, scored = parts["kl_ctl"], [r for r in rollouts if is_scored(r)]
    samples = [r.sample({"rollout_logprobs": r.response_extra(r.logprobs)}) for r in scored]
    _old_and_reference_logprobs(cfg, parts, samples)
    coef, found, kls = ctl.coef, {}, []
    for r, s in zip(scored, samples):
        model = torch.tensor(_model_tokens(r), dtype=torch.float)
        kl = kl_estimate(r.response_part(s.extras["old_logprobs"]), r.response_part(s.extras["ref_logprobs"]),
                         cfg.algorithm.kl_estimator, clamp=cfg.algorithm.kl_clamp) * model
        kls.append(float(kl.sum() / model.sum().clamp(min=1)))
        found[id(r)] = {"old_logprobs": s.extras["old_logprobs"], "ref_logprobs": s.extras["ref_logprobs"],
                        "penalty": coef * kl}
    if not kls:
        return [None] * len(rollouts), {}
    step_kl = sum(kls) / len(kls)
    ctl.update(step_kl, len(kls))
    return [found.get(id(r)) for r in rollouts], {"kl_reward/coef": coef, "kl_reward/kl": step_kl}


def select_samples(cfg, rollouts: list[Rollout], rewards: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Keep mask [N] after the zero-variance and overlong filters, and what each dropped. Lost episodes
    (`is_scored` False) are dropped, and the zero-variance filter judges a group by its scored samples."""
    from megatron_rl.algorithms.filters import overlong, zero_variance_groups

    keep = torch.tensor([is_scored(r) for r in rollouts], dtype=torch.bool)
    stats = {"filter/dropped_episodes": float((~keep).sum())} if not keep.all() else {}
    if cfg.algorithm.filter_zero_variance:
        informative = torch.zeros_like(keep)
        informative[keep] = zero_variance_groups(rewards[keep], torch.tensor([r.prompt_index for r in rollouts])[keep])
        stats["filter/zero_variance_dropped"] = float((keep & ~informative).sum())
        keep &= informative
    if cfg.algorithm.overlong == "filter":
        # dtypes given: a step whose dynamic sampling kept no group has no rollouts, and torch.tensor([]) is float
        single = torch.tensor([not hasattr(r, "model_mask") for r in rollouts], dtype=torch.bool)  # see shaped_rewards
        lengths = torch.tensor([float(len(r.output_ids)) for r in rollouts], dtype=torch.float32)
        truncated = torch.tensor([r.finish_reason == "length" for r in rollouts], dtype=torch.bool)
        fits, _ = overlong(lengths, cfg.rollout.max_new_tokens, "filter", truncated=truncated)
        fits |= ~single
        stats["filter/overlong_dropped"] = float((keep & ~fits).sum())
        keep &= fits
    stats["filter/kept_samples"] = float(keep.sum())
    return keep, stats


def rl_step(rt, parts: dict, step: int) -> dict[str, float]:
    """One RL step after `step` others (its sampling seeds and schedules count from 0); the step's number in
    the log, in metrics.jsonl and in the files it writes is step + 1, the updates done once it ends
    (docs/rl.md, "Metrics"). Returns its metrics, those each rank counts on its own summed over the ranks."""
    from megatron_rl.algorithms.filters import zero_variance_groups
    from megatron_rl.observability.reduce import reduce_over_ranks
    from megatron_rl.observability.timeline import Timeline

    cfg = rt.cfg
    controller, verifier = parts["controller"], parts["rewards"].verifier
    calls_before, errors_before = getattr(verifier, "calls", 0), getattr(verifier, "errors", 0)
    answers_before = dict(getattr(verifier, "answer_counts", {}))  # rule verifiers: how answers were read
    controller.timeline = timeline = Timeline()  # this step's phases, generation batches, environment waits
    if cfg.rollout.replay_dir is not None:  # debugging: a dumped run's samples, nothing generated
        from megatron_rl.rollout.dump import read_rollouts

        rollouts, timing = read_rollouts(cfg.rollout.replay_dir, step + 1), {}
    elif cfg.rollout.mode == "disaggregated":  # groups from the generators' experience buffer (megatron_rl/disagg/)
        rollouts, timing = controller.step_rollouts(rt, parts, step)
    else:
        rollouts, timing = generate_groups(rt, parts, step)
    uncovered_routing(rollouts)
    if cfg.logging.dump_rollouts and rt.is_main:
        from megatron_rl.rollout.dump import write_rollouts

        tokenizer = parts["tokenizer"]
        write_rollouts(rt.run_dir / "rollouts", step + 1, rollouts, lambda ids: tokenizer.decode(ids))
    rewards = shaped_rewards(cfg, rollouts)
    joint = parts.get("domains")  # multi-domain runs: per-domain calibration before the advantages
    penalised, kl_metrics = (reward_kl(cfg, parts, rollouts) if cfg.algorithm.kl_in_reward
                             else ([None] * len(rollouts), {}))
    critic, critic_time = parts.get("critic"), time.perf_counter()
    values = critic_values(parts, rollouts) if critic is not None else None
    critic_time = time.perf_counter() - critic_time
    advantages, returns = step_advantages(cfg, rollouts, rewards, joint, [p and p["penalty"] for p in penalised]
                                          if cfg.algorithm.kl_in_reward else None, values)
    keep, filter_stats = select_samples(cfg, rollouts, rewards)
    samples = [r.sample({"advantages": r.response_extra(a), "rollout_logprobs": r.response_extra(r.logprobs),
                         **{k: v for k, v in (p or {}).items() if k != "penalty"},
                         **({"returns": r.response_extra(returns[i]), "old_values": r.response_extra(values[i])}
                            if critic is not None else {})})
               for i, (r, a, k, p) in enumerate(zip(rollouts, advantages, keep, penalised)) if k]
    metrics: dict[str, float] = {}
    start = time.perf_counter()
    # algorithm.critic_warmup_steps: counted in the critic's own updates (a critic started on resume warms up too)
    warming = critic is not None and critic.step < cfg.algorithm.critic_warmup_steps * cfg.algorithm.num_inner_updates
    if samples and not warming:
        with timeline.span("train", "phases"):
            metrics = _update(cfg, parts, samples)
    elif not samples:
        logger.warning("step %d: every sample was filtered out; no update this step", step + 1)
    train_time = time.perf_counter() - start
    if samples and critic is not None:
        start = time.perf_counter()
        with timeline.span("critic", "phases"):
            metrics.update(_update_critic(cfg, parts, samples))
        metrics["time/critic"] = critic_time + time.perf_counter() - start  # its forward and its update
    scored = [is_scored(r) for r in rollouts]
    raw = torch.tensor([r.reward for r, s in zip(rollouts, scored) if s])
    scored_values = rewards[torch.tensor(scored, dtype=torch.bool)]
    lengths = torch.tensor([float(len(r.output_ids)) for r in rollouts])
    group_ids = torch.tensor([r.prompt_index for r, s in zip(rollouts, scored) if s], dtype=torch.long)
    tokens = sum(s.tokens.numel() for s in samples)
    if cfg.rollout.replay_dir is None:  # a replay ran no rollout: the controller holds an evaluation's timings
        metrics.update(controller.metrics())
    metrics.update(**timing, **filter_stats, **kl_metrics)
    metrics.update({"reward/mean": raw.mean().item(), "response_length/mean": lengths.mean().item(),
                    "reward/shaped_mean": scored_values.mean().item(),
                    "reward/zero_variance_groups":
                        (~zero_variance_groups(scored_values, group_ids)).float().mean().item(),
                    "time/train": train_time, "tokens_per_s": tokens / max(train_time, 1e-9),
                    "weight_version": float(rollouts[0].weight_version) if rollouts else float(controller.version),
                    "reward/verifier_calls": float(getattr(verifier, "calls", 0) - calls_before),
                    "reward/verifier_errors": float(getattr(verifier, "errors", 0) - errors_before)})
    metrics.update({f"reward/{k}": float(v - answers_before.get(k, 0))
                    for k, v in getattr(verifier, "answer_counts", {}).items()})
    if joint:
        kept = [(r, a) for r, a in zip(rollouts, advantages) if a is not None]
        metrics.update(joint.step_metrics(step, [r for r, _ in kept],
                                          torch.tensor([a.mean().item() if a.numel() else 0.0 for _, a in kept])))
    if metrics.get("time/generate_only"):  # single-turn rollouts: rank 0's engine, summed over dynamic sampling rounds
        metrics["rollout/tokens_per_s"] = metrics.get("rollout/generated_tokens", 0.0) / metrics["time/generate_only"]
    if warming:  # the critic's warm-up: the policy trained on nothing, no throughput to report
        metrics.pop("tokens_per_s")
    metrics.update(_maintain(rt, parts, step, rollouts))
    if any(e["track"] == "engine" for e in timeline.events):  # the step's engine time, training included
        metrics["sched/step_engine_busy"] = timeline.busy("engine") / max(time.perf_counter() - timeline.origin, 1e-9)
    metrics.update(_sandbox_metrics(parts))
    if cfg.logging.trace_every and step % cfg.logging.trace_every == 0 and rt.is_main:
        timeline.to_chrome_trace(rt.run_dir / "traces" / f"step_{step + 1:08d}.json")
    metrics = reduce_over_ranks(metrics)
    if metrics.get("reward/answers"):  # shares over every rank's answers
        for kind in ("unformatted", "last_number"):
            if f"reward/{kind}_answers" in metrics:
                metrics[f"reward/{kind}_share"] = metrics[f"reward/{kind}_answers"] / metrics["reward/answers"]
    return metrics


def _sandbox_client(parts: dict) -> Any:
    return getattr(parts["rewards"].verifier, "client", None)


def _sandbox_metrics(parts: dict) -> dict[str, float]:
    """Queue depth, waits and back-pressure per priority class, from the sandbox client."""
    import asyncio

    client = _sandbox_client(parts)
    if client is None or not hasattr(client, "metrics"):
        return {}
    try:
        return asyncio.run_coroutine_threadsafe(client.metrics(), parts["rewards"].loop).result(10)
    except Exception as err:  # metrics must never stop training
        logger.debug("sandbox metrics unavailable: %s", err)
        return {}


def _maintain(rt, parts: dict, step: int, rollouts: list[Rollout]) -> dict[str, float]:
    """Environment-pool statistics and refresh (task.pool_refresh_every), the reward audit
    (logging.audit_every)."""
    cfg, out = rt.cfg, {}
    pool = parts.get("env_pool")
    if pool is not None:
        for r in rollouts:
            if is_scored(r):  # a lost episode's 0 is no verdict (it made good tasks look flaky)
                pool.observe(r.source_index, r.reward, str(hash(tuple(r.output_ids))))
        if (step + 1) % cfg.task.pool_refresh_every == 0:
            pool.gc_and_refresh(step + 1)
        out.update(pool.metrics())
    if cfg.logging.audit_every and step % cfg.logging.audit_every == 0 and rt.is_main:
        from megatron_rl.rewards.audit import audit

        out.update(audit(step + 1, rollouts, _decode(parts["tokenizer"]), rt.run_dir / "audit",
                         cfg.logging.audit_samples))
    return out


def _old_and_reference_logprobs(cfg, parts: dict, samples: list, record_routing: bool = False) -> None:
    """Fill in the samples' "old_logprobs" (the trainer's forward, or the engine's with
    algorithm.old_logprobs=rollout) and, with kl_coef > 0, "ref_logprobs", where not given already
    (`reward_kl` computed them before the advantages). Every rank holds the same samples.
    record_routing: the old forward runs over all of `samples` (the same weights give the log-probs
    `reward_kl` found) and leaves its MoE routing in the trainer's `last_routing`. With
    algorithm.routing_replay=rollout the old forward routes as the engine did (the reference's routes freely)."""
    from megatron_rl.trainer.routing_replay import ENGINE

    trainer = parts["trainer"]
    missing = [s for s in samples if record_routing or "old_logprobs" not in s.extras]
    if missing and cfg.algorithm.old_logprobs == "recompute":
        old, _ = trainer.forward_logprobs(missing, record_routing=record_routing,
                                          routing=ENGINE if cfg.algorithm.routing_replay == "rollout" else None)
        for s, lp in zip(missing, old):
            s.extras["old_logprobs"] = lp
    elif missing:
        for s in missing:
            s.extras["old_logprobs"] = s.extras["rollout_logprobs"]
    missing = [s for s in samples if "ref_logprobs" not in s.extras]
    if cfg.algorithm.kl_coef > 0 and missing:  # the reference policy lives in host memory except for this forward
        current = trainer.swap_weights(parts["reference"])
        ref, _ = trainer.forward_logprobs(missing)
        trainer.swap_weights(current)
        for s, lp in zip(missing, ref):
            s.extras["ref_logprobs"] = lp


# The policy loss's KL terms (algorithms/objective.py) by what they compare, as metrics.jsonl names them
KL_METRICS = {"ppo_kl": "kl/policy_old_new", "kl": "kl/ref"}


def _update(cfg, parts: dict, samples: list) -> dict[str, float]:
    """Old (and reference) log-probs, then the policy update(s) on `samples`; the last update's metrics,
    with `kl/policy_old_new` (the approximate KL(old || updated policy) of the last update's tokens),
    `kl/policy_old_new_first_update` (the first's: 0 when the old log-probs are the trainer's own) and,
    with reference log-probs, `kl/ref` (the policy's KL to the reference, algorithm.kl_estimator). With
    algorithm.routing_replay every update routes as the old forward (old) or the engine (rollout) did
    (routing/drift: the share of expert choices the last update's routers would have made differently)."""
    from megatron_rl.trainer.routing_replay import ENGINE

    trainer, replay = parts["trainer"], cfg.algorithm.routing_replay
    _old_and_reference_logprobs(cfg, parts, samples, record_routing=replay == "old")
    routing = {"none": None, "old": trainer.last_routing, "rollout": ENGINE}[replay]
    trainer.last_routing = None
    mismatch = max((float((s.extras["old_logprobs"] - s.extras["rollout_logprobs"])[s.loss_mask.bool()].abs().max())
                    for s in samples if s.loss_mask.any()), default=0.0)
    for update in range(cfg.algorithm.num_inner_updates):
        found = trainer.train_step(samples, parts["loss_fn"], with_entropy=True, routing=routing)
        metrics = {KL_METRICS.get(name, name): value for name, value in found.items()}
        if update == 0:  # nothing changed yet: the importance ratio must be 1
            first_kl = metrics.get("kl/policy_old_new", 0.0)
    metrics.update({"rollout/logprob_mismatch": mismatch, "kl/policy_old_new_first_update": first_kl})
    if routing is not None:
        metrics["routing/drift"] = metrics.pop("routing_drift")
    return metrics


def critic_values(parts: dict, rollouts: list[Rollout]) -> list[Optional[torch.Tensor]]:
    """The critic's values of each scored rollout's response positions, [len(output_ids)] (None for a lost
    one): entry t is V of the state before response token t."""
    scored = [r for r in rollouts if is_scored(r)]
    if not scored:
        return [None] * len(rollouts)
    values, _ = parts["critic"].forward_logprobs([r.sample({}) for r in scored])
    found = {id(r): r.response_part(v) for r, v in zip(scored, values)}
    return [found.get(id(r)) for r in rollouts]


def _update_critic(cfg, parts: dict, samples: list) -> dict[str, float]:
    """The critic's update(s) on `samples` (extras "returns" and "old_values"), as many as the policy's;
    metrics under critic/, with the explained variance of the returns by the pre-update values,
    1 - Var(R - V) / Var(R) over the batch's loss tokens (1: perfect, 0: no better than their mean)."""
    mask = torch.cat([s.loss_mask for s in samples]).bool()
    returns = torch.cat([s.extras["returns"] for s in samples])[mask]
    old = torch.cat([s.extras["old_values"] for s in samples])[mask]
    spread = float(returns.var(unbiased=False)) if returns.numel() else 0.0
    # returns that are all equal (rounding aside: R = A + V of rewards all 0) explain nothing: nan
    explained = 1.0 - float((returns - old).var(unbiased=False)) / spread if spread > 1e-12 else float("nan")
    for _ in range(cfg.algorithm.num_inner_updates):
        found = parts["critic"].train_step(samples, parts["value_loss_fn"])
    metrics = {f"critic/{k}": v for k, v in found.items() if k != "num_tokens"}
    metrics["critic/explained_variance"] = explained
    return metrics


def evaluation_records(rt, parts: dict, repeat: int = 0) -> tuple[list[dict[str, Any]], list[Rollout]]:
    """Per-sample records (megatron_rl/evaluation/records.py) and rollouts of `task.eval_samples`
    samples for each of `parts["eval"]`, with the current weights. Repeat 0 draws what every
    training-time evaluation draws; offline evaluation's further seeds are repeats 1, 2, ..."""
    cfg, prompts = rt.cfg, parts["eval"]
    params = _sampling(cfg, parts, cfg.task.eval_samples, seed=cfg.seed * 7 + 1 + 7919 * repeat, evaluation=True)
    client = _sandbox_client(parts)
    trained_as = getattr(client, "priority_class", None)
    if trained_as is not None:  # evaluation traffic is its own class at the sandbox (weighted fair queueing)
        client.priority_class = "evaluation"
    try:
        rollouts, _ = parts["controller"].rollout(lambda: _generate(rt, parts, prompts, params))
    finally:
        if trained_as is not None:
            client.priority_class = trained_as
    return records_from_rollouts(prompts, rollouts, parts["task"].reward_scale_of), rollouts


def evaluate(rt, parts: dict, step: int) -> dict[str, float]:
    """Mean reward (accuracy) and pass@k on the held-out prompts, with the current weights."""
    prompts = parts["eval"]
    if not prompts:
        return {}
    k = rt.cfg.task.eval_samples
    records, rollouts = evaluation_records(rt, parts)  # the same draws at every evaluation
    found = eval_metrics(records, [k])
    accuracy, pass_k = found["accuracy"], found[f"pass@{k}"]
    logger.info("eval at step %d: accuracy %.3f, pass@%d %.3f (%d prompts)", step, accuracy, k, pass_k, len(prompts))
    per_domain = parts["domains"].eval_metrics(step, prompts, rollouts) if parts.get("domains") else {}
    lost = sum(bool(r["lost"]) for r in records)
    if lost:
        logger.warning("eval at step %d: %d of %d samples got no verdict (sandbox or verifier failures) and are "
                       "left out of the metrics", step, lost, len(records))
    return {"eval/accuracy": accuracy, "eval/pass@k": pass_k, "eval/samples": float(len(rollouts) - lost),
            "eval/lost": float(lost), "eval/truncated": found["truncated"], **_lenient_accuracy(parts, rollouts),
            **per_domain}


def _lenient_accuracy(parts: dict, rollouts: list[Rollout]) -> dict[str, float]:
    """A single-task run with reward=math read strictly: the held-out accuracy had each answer been read by
    its last number too (`eval/accuracy_last_number`), beside the share of answers in no asked format
    (`eval/unformatted`). A gain in the strict accuracy alone is a format gain; a skill gain lifts both."""
    from megatron_rl.rewards.rule import score_answer

    task = parts["task"]
    if getattr(task, "reward_kind", None) != "math" or task.cfg.answer_extraction != "strict":  # one task, no domains
        return {}
    decode, prompts = _decode(parts["tokenizer"]), parts["eval"]
    rollouts = [r for r in rollouts if is_scored(r)]  # as the strict accuracy: over the samples with a verdict
    if not rollouts:
        return {}
    right = unformatted = 0.0
    for r in rollouts:
        reward, how = score_answer(decode(list(r.output_ids)), prompts[r.prompt_index].meta["answer"],
                                   task.cfg.reward_tolerance, last_number=True)
        right, unformatted = right + reward, unformatted + (how not in ("boxed", "####"))
    return {"eval/accuracy_last_number": right / len(rollouts), "eval/unformatted": unformatted / len(rollouts)}
