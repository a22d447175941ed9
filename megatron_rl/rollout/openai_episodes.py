"""Agent episodes played by a black-box agent program against the rollout's OpenAI-compatible endpoint
(`openai_server`), and the training sample each becomes, built from the tokens the engine recorded.

Per step, `run_program_episodes` registers one episode id per (task, sample), opens the endpoint on the engine
(the rollout phase: it holds the weights), runs the program per episode (`envs.agent_program`: a Python
callable in a thread or a command in a process, up to `max_concurrency` at once; their calls are batched into
the engine's generate), then closes it and builds the episodes.

`build_episode` turns an episode's recorded calls into an `Episode` (the multi-turn rollout's sample format):
the first call's prompt ids are the prompt; each completion's ids are the model's tokens (loss mask 1, the
engine's log-probs); what the next call's prompt adds after them (the tool result, the next user turn, the
template's framing) is observation (mask 0). Nothing is re-tokenised: the next call's prompt must extend the
previous call's prompt + completion token for token, as the engine saw them. When it does not (the chat
template renders the history differently from what was generated: a reply's special tokens dropped by decoding,
a template that rewrites past assistant turns, a stop string cut from the returned text, an agent that edits
or branches its history), the episode is not spliced: its status is `mismatch`, it is left out of training and
counted (`agent/mismatch`) and logged with the first differing position. An episode whose calls were sampled at
another temperature or top_p than the trainer's log-probs assume is left out likewise (`sampling_mismatch`);
one whose program failed, or that made no call, is `agent_failed`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from typing import Any, Optional, Sequence

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.multiturn import Episode, EpisodeLimits
from megatron_rl.rollout.openai_server import Call, OpenAIServer, ServeSettings

logger = logging.getLogger(__name__)


def build_episode(group: int, calls: Sequence[Call], temperature: float, top_p: float) -> Episode:
    """The training sample of one episode's calls (arrival order), or an episode marked `mismatch` /
    `sampling_mismatch` / `agent_failed` (see the module docstring) that takes no part in training."""
    episode = Episode(group, [], [], [], "stop", -1)
    if not calls:
        episode.status, episode.info = "agent_failed", {}
        logger.warning("agent episode of task %d made no call to the endpoint: not trained on", group)
        return episode
    episode.prompt_tokens = list(calls[0].prompt_ids)
    for call in calls:
        if call.temperature != temperature or call.top_p != top_p:
            episode.status = "sampling_mismatch"
            logger.warning("agent episode of task %d: call %d sampled at temperature %g, top_p %g, but the trainer's "
                           "log-probs assume %g, %g (rollout.temperature, rollout.top_p): not trained on", group,
                           call.index, call.temperature, call.top_p, temperature, top_p)
            return episode
    seen = list(calls[0].prompt_ids)  # everything the engine has seen of this episode so far
    for k, call in enumerate(calls):
        if k > 0:
            extends = call.prompt_ids[:len(seen)] == seen
            if not extends:
                where = next((i for i, (a, b) in enumerate(zip(seen, call.prompt_ids)) if a != b),
                             min(len(seen), len(call.prompt_ids)))
                episode.status = "mismatch"
                logger.warning("agent episode of task %d: call %d's prompt does not extend the tokens the engine saw "
                               "and produced before it (they differ from token %d on: %s vs %s): the history was "
                               "re-tokenised differently, so it is not trained on", group, k, where,
                               seen[where:where + 8], call.prompt_ids[where:where + 8])
                return episode
            added = call.prompt_ids[len(seen):]
            episode.output_ids += added
            episode.logprobs += [0.0] * len(added)
            episode.model_mask += [0] * len(added)
            seen += added
        choice = _followed(calls, k, seen)
        if choice is None:
            episode.status = "mismatch"
            logger.warning("agent episode of task %d: call %d asked for n=%d completions and none is the one the "
                           "episode went on with (or it was the last call): a branching episode is not trained on",
                           group, k, len(call.choices))
            return episode
        episode.output_ids += choice.output_ids
        episode.logprobs += choice.logprobs
        episode.model_mask += [1] * len(choice.output_ids)
        episode.turn_versions.append(choice.weight_version)
        seen += choice.output_ids
        episode.finish_reason = choice.finish_reason
    episode.weight_version = episode.turn_versions[0]  # a rollout's version is its first token's
    episode.num_turns = len(calls)
    episode.status = "submitted"
    return episode


def _followed(calls: Sequence[Call], k: int, seen: list[int]) -> Optional[Any]:
    """The choice of call k the episode continued with: its only one, or (n > 1) the one the next call's
    prompt extends; None when that is not one choice."""
    choices = calls[k].choices
    if len(choices) == 1:
        return choices[0]
    if k + 1 == len(calls):
        return None
    nxt = calls[k + 1].prompt_ids
    matching = [c for c in choices if nxt[:len(seen) + len(c.output_ids)] == seen + c.output_ids]
    return matching[0] if len(matching) == 1 else None


def run_program_episodes(engine: Any, host: Any, tokenizer: Any, tasks: Sequence[dict[str, Any]], n: int,
                         params: SamplingParams, limits: EpisodeLimits,
                         max_concurrency: int = 64) -> list[Episode]:
    """`n` episodes per task played by `host`'s agent program through the endpoint (group id = task index);
    returns them all, lost ones included (their statuses are counted by `multiturn.episode_metrics`)."""
    if host.server is None:  # one endpoint for the run: its address stays the same from step to step
        host.server = OpenAIServer(tokenizer, port=host.port, wait_s=host.wait_s, max_batch=max_concurrency).start()
        logger.info("OpenAI-compatible endpoint for the agent program: %s (model %r)", host.server.base_url,
                    host.model)
    server = host.server
    settings = ServeSettings(host.model, params.temperature, params.top_p, params.top_k, params.max_new_tokens,
                             limits.max_tokens)
    run = uuid.uuid4().hex[:8]
    ids = [(f"{run}-{g}-{k}", g) for g, _ in enumerate(tasks) for k in range(n)]
    server.register([eid for eid, _ in ids])
    outcomes: dict[str, Any] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(ids))),
                                                 thread_name_prefix="agent-program")
    with server.serving(engine, settings):
        running = {eid: pool.submit(host.play, server.base_url, eid, tasks[g]) for eid, g in ids}
        give_up = time.monotonic() + host.timeout_s + 5  # a command is killed at its timeout; a function is not
        for eid, future in running.items():
            try:
                outcomes[eid] = future.result(timeout=max(give_up - time.monotonic(), 0.0))
            except concurrent.futures.TimeoutError:
                outcomes[eid] = TimeoutError(f"the agent function ran past task.agent_timeout_s={host.timeout_s:g}")
            except Exception as exc:  # the program failed: said, and the episode counted as lost
                outcomes[eid] = exc
        # not waiting for a function that hangs: once the endpoint closes below, its calls get 503
        pool.shutdown(wait=False, cancel_futures=True)
    episodes = []
    for eid, g in ids:
        calls = server.take(eid)
        outcome = outcomes[eid]
        if isinstance(outcome, BaseException):
            logger.warning("agent program of episode %s (task %d) failed, not trained on: %s", eid, g, outcome)
            episode = Episode(g, list(calls[0].prompt_ids) if calls else [], [], [], "stop", -1, status="agent_failed")
        else:
            episode = build_episode(g, calls, params.temperature, params.top_p)
            if episode.status == "submitted":
                episode.reward, episode.info = outcome[0], dict(outcome[1])
        episodes.append(episode)
    host.calls += len(episodes)
    host.errors += sum(e.status == "agent_failed" for e in episodes)
    return episodes
