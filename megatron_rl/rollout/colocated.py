"""Colocated rollout: generation on this job's own engine, time-shared with the trainer.

`Generation` is what generating needs (engine, task, tokenizer, reward service, layout): single-turn
completions through `collect`, multi-turn episodes through `collect_episodes`, and a joint run's
single-turn and agent domains one after the other. Training steps, evaluation and the warm start's
reference episodes all use it.

`ColocatedSource` is the RolloutSource (megatron_rl/rollout/source.py) of rollout.mode=colocated: per
step, inside one colocation round (offload the trainer, sync weights, generate, hand back), rounds of
global_batch_size / n prompts from the sampler, repeated with dynamic sampling until enough groups
carry a signal; with rollout.oversample, the groups beyond the batch are cut.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any, Optional, Sequence

from megatron_rl.rewards.shaping import group_verdicts
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.collect import Rollout, collect
from megatron_rl.rollout.source import ControllerVersion

logger = logging.getLogger(__name__)


def reward_wait(cfg) -> float:
    """How long the collector waits for a chunk's rewards: 300 s, or longer when a reward function
    may take longer per call (task.reward_timeout_s)."""
    tasks = [d.task for d in cfg.domains.values()] if cfg.domains else [cfg.task]
    return max(300.0, *(2 * t.reward_timeout_s for t in tasks))


@dataclasses.dataclass
class DomainRewards:
    """What `collect_episodes` needs of the reward service, for one agent domain of a joint run."""

    verifier: Any  # the domain's environment host
    loop: Any


@dataclasses.dataclass
class Generation:
    """Generating on this job's engine: `generate` for prompts of the run's task (its domains in a joint
    run), `sampling` for training's or evaluation's sampling settings. `controller` is the colocation
    controller, whose step timeline agent episodes record on."""

    cfg: Any
    groups: Any
    engine: Any
    task: Any
    tokenizer: Any
    rewards: Any
    controller: Any
    turn_formats: dict = dataclasses.field(default_factory=dict)  # agent tasks: one per system prompt

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def sampling(self, n: int, seed: int, evaluation: bool = False) -> SamplingParams:
        """Training's sampling settings (rollout.*), or evaluation's: task.eval_* where set."""
        cfg = self.cfg
        r, t = cfg.rollout, cfg.task

        def pick(own: Any, default: Any) -> Any:
            return default if own is None or not evaluation else own
        return SamplingParams(temperature=pick(t.eval_temperature, r.temperature), top_p=pick(t.eval_top_p, r.top_p),
                              top_k=pick(t.eval_top_k, r.top_k),
                              max_new_tokens=pick(t.eval_max_new_tokens, r.max_new_tokens), n=n, seed=seed,
                              stop_token_ids=self.task.stop_token_ids, stop=tuple(r.stop),
                              return_routing=cfg.algorithm.routing_replay == "rollout" and not evaluation)

    def turn_format(self, task_cfg: Any) -> Any:
        """The agent task's chat-template pieces (made once per system prompt)."""
        from megatron_rl.rollout.multiturn import TurnFormat, task_system_prompt

        system = task_system_prompt(task_cfg)
        if system not in self.turn_formats:
            self.turn_formats[system] = TurnFormat(self.tokenizer, system)
        return self.turn_formats[system]

    def generate(self, prompts: list, params: SamplingParams,
                 training: bool = False) -> tuple[list[Rollout], dict[str, float]]:
        """Completions and rewards: one per sample, or whole multi-turn episodes for agent tasks;
        a joint run with agent domains does both (`_domains`). Only a training step's
        rollouts (`training`) are over-sampled and cut at the step deadline: evaluation plays every
        prompt to its end."""
        if getattr(self.task, "agent_domains", ()):
            return self._domains(prompts, params, training)
        if not self.task.is_agent:
            return self._completions(prompts, params)
        return self.episodes(prompts, params, self.task.cfg, self.rewards, training)

    def _completions(self, prompts: list, params: SamplingParams) -> tuple[list[Rollout], dict[str, float]]:
        """Single-turn completions and their rewards; a judged task's (task.reward=judge) from the judge, on the
        same engine in the same round (rollout/judging.py)."""
        from megatron_rl.rollout.judging import judge_rollouts

        rollouts, stats = collect(self.engine, prompts, params, self.rewards, self.groups, self.decode,
                                  num_chunks=self.cfg.rollout.generate_chunks, reward_timeout_s=reward_wait(self.cfg))
        judged = judge_rollouts(self.engine, self.groups, self.task, prompts, rollouts, self.decode)
        # a reply without verdict is a sample without reward, as a failed verifier's: counted with them too. Every
        # rank judged every rollout alike, and reward/unscored is summed over the ranks (observability/reduce.py):
        # rank 0 alone adds the judge's count
        if self.groups.rank == 0:
            failures = judged.get("reward/judge_parse_failures", 0.0)
            stats["reward/unscored"] = stats.get("reward/unscored", 0.0) + failures
        return rollouts, {**stats, **judged}

    def episodes(self, prompts: list, params: SamplingParams, task_cfg: Any, rewards: Any, training: bool,
                 target: Optional[int] = None) -> tuple[list[Rollout], dict[str, float]]:
        """Agent task `task_cfg`'s prompts played as episodes (its turn format and episode limits).
        In a training step with over-sampling, the groups beyond the first `target` done are cut
        (default: the batch's groups, global_batch_size / n), and episodes stop at the step deadline."""
        from megatron_rl.rollout.episodes import collect_episodes
        from megatron_rl.rollout.multiturn import EpisodeLimits

        r = self.cfg.rollout
        if not training:
            target = None
        elif r.oversample and target is None:
            target = self.cfg.global_batch_size // params.n
        got, stats = collect_episodes(self.engine, prompts, params, rewards, self.groups, self.turn_format(task_cfg),
                                      EpisodeLimits.of(task_cfg), r.agent_scheduler, r.max_concurrent_episodes,
                                      target, self.controller.timeline, r.step_deadline_s if training else None,
                                      r.straggler_policy == "partial")
        if target is not None:
            cut_beyond(got, target)
        return got, stats

    def _domains(self, prompts: list, params: SamplingParams,
                 training: bool) -> tuple[list[Rollout], dict[str, float]]:
        """A joint run with agent domains: the single-turn domains' prompts in one `collect`, then
        each agent domain's episodes with its own environments, turn format and episode limits, one
        after the other on the same engine (every rank runs the same sequence: both paths hold
        collectives). Rollouts come back in prompt order; an agent domain's episode metrics are
        logged under `domain/<name>/`, time spent is summed.

        In a training step with over-sampling (rollout.oversample) the batch's groups are shared out over the
        parts in proportion to their prompts (`apportion`), so that the mixture keeps its weights: an agent
        domain cuts its groups beyond its share, the single-turn part, whose groups all finish,
        generates only its share (the rest of its prompts are skipped, like cut ones)."""
        task, agents = self.task, self.task.agent_domains
        shares: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            domain = p.meta["domain"]
            shares.setdefault(domain if domain in agents else "", []).append(i)
        targets: dict[str, int] = {}
        if training and self.cfg.rollout.oversample:
            batch_groups = self.cfg.global_batch_size // params.n
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
                got, stats = self._completions(mine, params)
            else:
                view = DomainRewards(self.rewards.verifier.verifiers[domain], self.rewards.loop)
                got, stats = self.episodes(mine, params, task.tasks[domain].cfg, view, training, targets.get(domain))
                stats = {(k if k.startswith("time/") else f"domain/{domain}/{k}"): v for k, v in stats.items()}
            for r in got:
                r.prompt_index = index[r.prompt_index]
                r.domain = prompts[r.prompt_index].meta["domain"]
            out += got
            for key, value in stats.items():
                timing[key] = timing.get(key, 0.0) + value
        out.sort(key=lambda r: r.prompt_index)  # stable: a group's samples keep their order
        return out, timing


def cut_beyond(rollouts: list[Rollout], target: int) -> None:
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


def _episode_mean_weight(key: str, stats: dict[str, float]) -> Optional[float]:
    """For an episode mean (`agent/turns_mean`, `agent/env/<k>`, also under a joint run's "domain/<d>/"), the
    count it is a mean over in `stats` (`agent/episodes`, `agent/env_count/<k>`); None for any other key."""
    for marker, count in (("agent/turns_mean", "agent/episodes"), ("agent/env/", "agent/env_count/")):
        at = key.find(marker)
        if at >= 0 and (at == 0 or key[:at].startswith("domain/")):
            name = key[at + len(marker):] if marker.endswith("/") else ""
            return stats.get(f"{key[:at]}{count}{name}", 0.0)
    return None


def combine_rounds(per_round: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's generation metrics from its dynamic-sampling rounds: times and counts add up; the
    episode means (`agent/turns_mean`, `agent/env/...`, also a joint run's `domain/<d>/...`) are
    weighted by the episodes each round's mean is over (`agent/episodes`, `agent/env_count/...`);
    `sched/engine_busy` by each round's `sched/wall_s`, the fraction of all the rounds' wall time the
    engine was busy (a sum would report 2 for an engine busy throughout two rounds)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    means = set()
    for stats in per_round:
        for key, value in stats.items():
            weight = 1.0
            if key.endswith("sched/engine_busy"):
                weight = stats.get(key[:-len("engine_busy")] + "wall_s", 0.0)
                means.add(key)
            elif (count := _episode_mean_weight(key, stats)) is not None:
                weight = count
                means.add(key)
            sums[key] = sums.get(key, 0.0) + value * weight
            weights[key] = weights.get(key, 0.0) + weight
    return {key: total / max(weights[key], 1e-9) if key in means else total for key, total in sums.items()}


class ColocatedSource(ControllerVersion):
    """The RolloutSource of rollout.mode=colocated (see the module docstring)."""

    def __init__(self, generation: Generation, sampler: Any, prompts: list) -> None:
        self.generation, self.controller = generation, generation.controller
        self.cfg, self.sampler, self.prompts = generation.cfg, sampler, prompts

    def rollouts(self, step: int, timeline: Any) -> tuple[list[Rollout], dict[str, float]]:
        """The step's rollouts, group ids unique across rounds, with the colocation round's timings and
        weight-sync stats. One round of global_batch_size / n prompts; with dynamic sampling, rounds
        repeat (inside one weight sync) until that many groups have reward variance or the round limit
        is hit."""
        from megatron_rl.algorithms.filters import DynamicSampler, has_reward_variance

        cfg, algo = self.cfg, self.cfg.algorithm
        self.controller.timeline = timeline
        n = cfg.rollout.n_samples_per_prompt
        num_groups = cfg.global_batch_size // n
        drawn = num_groups + round(num_groups * cfg.rollout.oversample)  # async agent rollouts cut the extra ones
        rounds = DynamicSampler(num_groups, algo.dynamic_sampling_max_rounds if algo.dynamic_sampling else 1,
                                has_reward_variance if algo.dynamic_sampling else (lambda rewards: True))

        def run() -> dict[str, float]:
            timing: dict[str, float] = {}
            per_round: list[dict[str, float]] = []
            while not rounds.done:
                indices = self.sampler.next_batch(drawn)
                prompts = [self.prompts[i] for i in indices]
                params = self.generation.sampling(n, seed=cfg.seed * 100_003 + step + 7919 * rounds.num_rounds)
                got, timing_round = self.generation.generate(prompts, params, training=True)
                for r in got:
                    r.source_index = indices[r.prompt_index]
                per_round.append(timing_round)
                by_prompt: dict[int, list[Rollout]] = {}  # a joint run may skip prompts (Generation._domains)
                for r in got:
                    by_prompt.setdefault(r.prompt_index, []).append(r)
                groups = [by_prompt[g] for g in sorted(by_prompt)]
                cut = [any(getattr(r, "status", "") == "aborted" for r in group) for group in groups]
                if cfg.rollout.oversample:
                    timing["sched/groups_cut"] = timing.get("sched/groups_cut", 0.0) + sum(cut)
                groups = [group for group, was_cut in zip(groups, cut) if not was_cut]
                if algo.dynamic_sampling:
                    # the round that fills the batch has its surplus cut from the end of its kept groups; in prompt
                    # order that end is the last domains' (a joint run draws domain after domain), so the trained
                    # mixture would lean to the first. In a seeded order (alike on every rank) no domain is last.
                    random.Random(params.seed).shuffle(groups)
                rounds.add_round(groups, [group_verdicts(group) for group in groups])
            return {**combine_rounds(per_round), **timing}

        timing, kept = self.controller.rollout(run), rounds.batch()
        if algo.dynamic_sampling:
            timing.update({f"dynamic_sampling/{k}": v for k, v in rounds.stats().items()})
            if rounds.exhausted:
                logger.warning("step %d: dynamic sampling kept %d/%d groups in %d rounds; training on the short "
                               "batch", step + 1, rounds.num_kept, num_groups, rounds.num_rounds)
        rollouts = [dataclasses.replace(r, prompt_index=g) for g, group in enumerate(kept) for r in group]
        return rollouts, {**self.controller.metrics(), **timing}
