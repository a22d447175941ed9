"""Generate completions for a batch of prompts across data-parallel ranks and collect their
rewards, overlapping reward computation with generation.

Each data-parallel rank generates for its contiguous share of the prompts (ranks of one
model-parallel group, context-parallel ranks included, generate identically: same weights,
same seed), in one engine call or in chunks (rollout.generate_chunks); as soon as a chunk is generated its
rewards are submitted to the reward service, and the next chunk generates meanwhile. The first rank of each
model-parallel group contributes its share to an all-gather, so every rank ends with the whole batch in prompt
order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.trainer.packing import Sample

logger = logging.getLogger(__name__)


# sandbox failure, cut straggler, past the step deadline, no reward came (verifier late or failed); an agent
# program's episode whose recorded tokens do not form one sequence, sampled with other settings than the trainer
# assumes, or whose program failed (rollout/openai_episodes.py)
LOST_STATUSES = ("dropped", "aborted", "deadline", "unscored", "mismatch", "sampling_mismatch", "agent_failed")


def is_scored(rollout: Any) -> bool:
    """False for a sample or episode that was lost (its `status` one of `LOST_STATUSES`): its 0 reward is no
    verdict on the model, so it takes no part in group baselines, filters, calibration, the loss, evaluation
    metrics or quality verdicts. Anything with a `status` (agent episodes too)."""
    return getattr(rollout, "status", "") not in LOST_STATUSES


def model_tokens(rollout: Any) -> list[int]:
    """1 on the response tokens the policy wrote, 0 on an episode's tool output (its `model_mask`)."""
    return list(getattr(rollout, "model_mask", None) or [1] * len(rollout.output_ids))


@dataclasses.dataclass
class Rollout:
    prompt_index: int  # index in the step's prompt list (= the GRPO group id)
    prompt_tokens: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    reward: float = 0.0
    domain: str = ""  # the prompt's meta["domain"] in a multi-domain run, else ""
    source_index: int = -1  # index of its prompt in the training prompt list (the sampler's index), if any
    status: str = ""  # "unscored": no reward came (verifier late or failed), so it is no verdict (is_scored)
    # the engine's MoE routing of every token it fed (Generation.routing), [L-1, MoE layers, k] int16: rollout
    # routing replay (algorithm.routing_replay=rollout)
    routing: Optional[torch.Tensor] = None
    # a model-scored task (task.reward=reward_model|judge): the model's score before reward_scale ("model_score"),
    # whether it passes task.rule_check_threshold ("model_passes") and the rule check's reward ("rule_reward")
    checks: dict = dataclasses.field(default_factory=dict)

    @property
    def scored(self) -> bool:
        """Whether its reward is a verdict (`is_scored`)."""
        return is_scored(self)

    def sample(self, extras: dict[str, torch.Tensor]) -> Sample:
        """The trainer's sample; with the engine's routing, extras["routing"] [L-1, MoE layers * k] (entry t: the
        experts of token t, which predicts target t; the last token predicts nothing, and no engine fed it)."""
        tokens = torch.tensor(self.prompt_tokens + self.output_ids, dtype=torch.long)
        mask = torch.zeros(len(tokens) - 1)
        mask[len(self.prompt_tokens) - 1:] = 1.0
        if self.routing is not None:
            extras = {**extras, "routing": self.routing.reshape(len(tokens) - 1, -1)}
        return Sample(tokens, mask, extras)

    def response_extra(self, values: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """Per-target tensor [L-1]: `values` on the response targets, 0 on the prompt."""
        out = torch.zeros(len(self.prompt_tokens) + len(self.output_ids) - 1)
        out[len(self.prompt_tokens) - 1:] = torch.as_tensor(values, dtype=torch.float)
        return out

    def response_part(self, per_target: torch.Tensor) -> torch.Tensor:
        """The response targets' entries [len(output_ids)] of a per-target tensor [L-1] (the inverse of
        `response_extra`; e.g. the trainer's log-probs or a critic's values of the sample)."""
        return per_target[len(self.prompt_tokens) - 1:]


def uncovered_routing(rollouts: Sequence[Rollout]) -> None:
    """Rollout routing replay packs every sample's extras["routing"] (the packer takes the first sample's keys):
    when some rollouts carry the engine's routing, one that never reached the engine (an episode that ended
    before its first turn) gets routing that covers none of its positions (-1: its tokens route freely)."""
    shape = next((r.routing.shape[1:] for r in rollouts if r.routing is not None), None)
    if shape is None:
        return
    for r in rollouts:
        if r.routing is None:
            r.routing = torch.full((len(r.prompt_tokens) + len(r.output_ids) - 1, *shape), -1, dtype=torch.int16)


def gather_rollouts(local: Optional[list]) -> list:
    """Every rank gets all the rollouts, ordered by prompt index: each data-parallel group
    contributes its first model-parallel rank's `local` list (the other ranks pass None)."""
    return gather_rollouts_with(local, None)[0]


def gather_rollouts_with(local: Optional[list], extra: Any) -> tuple[list, list]:
    """`gather_rollouts`, and in the same collective every rank's `extra`, in rank order."""
    everything = [(local, extra)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, (local, extra))
    rollouts = sorted((r for part, _ in everything if part for r in part), key=lambda r: r.prompt_index)
    return rollouts, [e for _, e in everything]


def _share(num: int, parts: int, index: int) -> range:
    base, extra = divmod(num, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def collect(engine: Any, prompts: Sequence[Any], params: SamplingParams, reward_service: Any, groups: Any,
            decode, num_chunks: int = 1, reward_timeout_s: float = 300.0) -> tuple[list[Rollout], dict[str, float]]:
    """Completions and rewards for `prompts` (objects with `.tokens` and `.meta`), on every rank; this rank's share
    in `num_chunks` engine calls (rollout.generate_chunks). Its metrics: `rollout/generated_tokens`, the response
    tokens of every rank's rollouts (the same on every rank), and `time/generate_only`, the seconds this rank's
    engine calls took (rewards not included)."""
    mine = _share(len(prompts), groups.dp_size, groups.dp_rank)
    local: list[Rollout] = []
    pending: list[tuple[int, concurrent.futures.Future]] = []
    gen_time = 0.0
    first_mp_rank = groups.is_first_model_parallel_rank
    indices = list(mine)
    step = max(1, -(-len(indices) // num_chunks))
    for chunk_start in range(0, len(indices), step):
        chunk = indices[chunk_start:chunk_start + step]
        start = time.perf_counter()
        seed = None if params.seed is None else params.seed * 1000 + chunk[0]
        gens = engine.generate([prompts[i].tokens for i in chunk], dataclasses.replace(params, seed=seed))
        gen_time += time.perf_counter() - start
        rollouts = [Rollout(chunk[g.prompt_index], list(prompts[chunk[g.prompt_index]].tokens), g.output_ids,
                            g.logprobs, g.finish_reason, g.weight_version, routing=g.routing) for g in gens]
        for r in rollouts:
            r.domain = prompts[r.prompt_index].meta.get("domain", "")
        if first_mp_rank:
            items = [(prompts[r.prompt_index].meta, decode(r.output_ids)) for r in rollouts]
            pending.append((len(local), reward_service.submit(items)))
        local += rollouts
    start = time.perf_counter()
    timeouts = failures = unscored = 0
    ends = [offset for offset, _ in pending[1:]] + [len(local)]
    for (offset, future), end in zip(pending, ends):
        try:
            scores = future.result(timeout=reward_timeout_s)
        except Exception as exc:  # noqa: BLE001  (late or failed: unscored, never a hung or crashed step)
            late = isinstance(exc, concurrent.futures.TimeoutError)
            timeouts, failures, unscored = timeouts + late, failures + (not late), unscored + end - offset
            if not late:
                logger.warning("rewards of %d samples failed (left out of the update): %s: %s", end - offset,
                               type(exc).__name__, exc, exc_info=exc)
            for r in local[offset:end]:
                r.status = "unscored"
            continue
        for k, score in enumerate(scores):
            if math.isnan(score):  # the verifier's "no verdict" (rewards/custom.py: NO_VERDICT)
                local[offset + k].status, unscored = "unscored", unscored + 1
            else:
                local[offset + k].reward = score
    wait = time.perf_counter() - start
    rollouts = gather_rollouts(local if first_mp_rank else None)
    # the whole step's tokens, alike on every rank: a rank's own share would undercount a job of several engines
    # (and an engine shared by ranks, rollout.tp > 1, generates their shares in one call of its time)
    generated = sum(len(r.output_ids) for r in rollouts)
    return rollouts, {
        "rollout/generated_tokens": float(generated), "time/generate_only": gen_time, "time/reward_wait": wait,
        "reward/timeouts": float(timeouts), "reward/failed_batches": float(failures),
        "reward/unscored": float(unscored)}
