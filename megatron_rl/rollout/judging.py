"""Generative judging on this job's own engine (task.reward=judge): after a round's completions are generated,
the same engine, holding the same weights, reads each judged response in the prompt `rewards/judge.py` writes
and states a verdict, greedily. It runs inside the colocation round that generated the responses (no second
weight sync), so dynamic sampling and evaluation see the judge's rewards like any verifier's.

A reply with no verdict leaves its sample unscored (`status="unscored"`: out of baselines and the loss, as a
failed verifier's) and is counted in `reward/judge_parse_failures` (and, by the caller, in `reward/unscored`);
each step with failures logs a warning with the first such reply. A reply cut at `task.judge.max_new_tokens`
is no verdict either (also counted in `reward/judge_cut`): the verdict comes last, so one read from a cut reply
is from its middle. Every data-parallel rank judges its share of
the responses (model-parallel ranks alike, as in `collect`), and the verdicts are gathered so that every rank
holds all of them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch.distributed as dist

from megatron_rl.rewards.judge import judge_prompt, parse_verdict
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.collect import Rollout, _share

logger = logging.getLogger(__name__)


def task_of(task: Any, meta: dict) -> Any:
    """The Task a prompt belongs to: its domain's in a joint run (a MultiTask), else the task itself."""
    tasks = getattr(task, "tasks", None)
    return tasks[meta["domain"]] if tasks is not None else task


def prompt_text(prompt: Any) -> str:
    """A task prompt as the judge reads it: the text, or a chat prompt's messages one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)


def judge_rollouts(engine: Any, groups: Any, task: Any, prompts: Sequence[Any], rollouts: list[Rollout],
                   decode: Callable[[list[int]], str]) -> dict[str, float]:
    """Replace the reward of every scored rollout of a judged task by the judge's verdict (times the task's
    reward_scale); a rule check's reward (task.rule_check) is kept in `checks`. Every rank calls it with the
    same rollouts. Returns reward/judge_calls, reward/judge_parse_failures and time/judge."""
    judged = [r for r in rollouts if r.scored and task_of(task, prompts[r.prompt_index].meta).reward_kind == "judge"]
    if not judged:
        return {}
    start = time.perf_counter()
    by_task: dict[int, list[Rollout]] = {}
    for r in judged:
        by_task.setdefault(id(task_of(task, prompts[r.prompt_index].meta)), []).append(r)
    failures, cut, first_failure = 0, 0, None
    for members in by_task.values():
        own = task_of(task, prompts[members[0].prompt_index].meta)
        replies = _generate(engine, groups, own, [_judge_tokens(own, prompts[r.prompt_index].meta, decode(r.output_ids))
                                                  for r in members], decode)
        for r, (reply, was_cut) in zip(members, replies):
            # a reply cut at judge.max_new_tokens never reached its verdict (the template asks for it last): a
            # `score: X` in it is from the middle, e.g. the judged response's own text quoted back
            verdict = None if was_cut else parse_verdict(own.cfg.judge, reply)
            cut += was_cut
            if own.cfg.rule_check is not None:
                r.checks["rule_reward"] = r.reward
            if verdict is None:
                failures += 1
                first_failure = first_failure if first_failure is not None else reply
                r.status, r.reward = "unscored", 0.0
                continue
            r.reward = verdict * own.cfg.reward_scale
            r.checks["model_score"] = verdict
            r.checks["model_passes"] = verdict > own.cfg.rule_check_threshold
    if failures:
        logger.warning("the judge gave no verdict for %d of %d responses (left unscored, counted in "
                       "reward/judge_parse_failures; %d of them cut at task.judge.max_new_tokens before the end of the "
                       "reply); the first reply: %r", failures, len(judged), cut, first_failure[:500])
    return {"reward/judge_calls": float(len(judged)), "reward/judge_parse_failures": float(failures),
            "reward/judge_cut": float(cut), "time/judge": time.perf_counter() - start}


def _judge_tokens(task: Any, meta: dict, response: str) -> list[int]:
    """The judge's prompt for one response, through the task's chat template when it uses one."""
    text = judge_prompt(task.cfg.judge, prompt_text(meta["question"]), response, meta.get("answer"))
    rendered = task.render(text)
    return task.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _generate(engine: Any, groups: Any, task: Any, token_lists: list[list[int]],
              decode: Callable[[list[int]], str]) -> list[tuple[str, bool]]:
    """The engine's greedy replies to every prompt, each with whether it was cut at max_new_tokens, on every rank
    (each data-parallel rank generates its share)."""
    mine = _share(len(token_lists), groups.dp_size, groups.dp_rank)
    params = SamplingParams(temperature=0.0, max_new_tokens=task.cfg.judge.max_new_tokens, n=1, seed=0,
                            stop_token_ids=task.stop_token_ids)
    gens = engine.generate([token_lists[i] for i in mine], params) if len(mine) else []
    local = {mine[g.prompt_index]: (decode(g.output_ids), g.finish_reason == "length") for g in gens}
    everything = [local if groups.is_first_model_parallel_rank else {}]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, local if groups.is_first_model_parallel_rank else {})
    replies = {i: text for part in everything for i, text in part.items()}
    return [replies[i] for i in range(len(token_lists))]
