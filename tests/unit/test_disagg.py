"""Disaggregated mode without processes: the staleness bound of the experience buffer, partial
rollouts across a weight update (against a scripted engine whose outputs are known by hand),
the timeline overlap measure, and the configuration checks."""

from __future__ import annotations

import dataclasses
import queue

import pytest
import torch

from megatron_rl.disagg.buffer import ExperienceBuffer, ExperienceGroup
from megatron_rl.disagg.events import overlap_seconds
from megatron_rl.rollout.base import Generation, SamplingParams
from megatron_rl.rollout.collect import Rollout
from megatron_rl.rollout.partial import generate_partial


def _group(request_id: int, versions: list[list[int]]) -> ExperienceGroup:
    rollouts = [Rollout(0, [1], [2] * len(v), [0.0] * len(v), "length", v[0], source_index=request_id)
                for v in versions]
    return ExperienceGroup(request_id, rollouts, versions, 0, (0.0, 1.0))


def test_buffer_drops_groups_older_than_the_bound_and_counts_them():
    q: queue.Queue = queue.Queue()
    # trainer version 5, max_staleness 1: versions 4 and 5 are fresh enough, 3 is not;
    # a group is as old as its oldest token (the [3, 4] group is stale).
    for request_id, versions in enumerate([[[3, 3]], [[4, 5]], [[3, 4]], [[5]], [[4], [4]]]):
        q.put(_group(request_id, versions))
    buffer = ExperienceBuffer(q, max_staleness=1)
    dropped: list[int] = []
    kept, stats = buffer.take(3, trainer_version=5, on_drop=lambda g: dropped.append(g.request_id), poll_s=0.01)
    assert [g.request_id for g in kept] == [1, 3, 4]
    assert dropped == [0, 2]
    assert stats["buffer/dropped_stale"] == 2 and buffer.dropped_total == 2
    assert stats["async/staleness_max"] == 1 and stats["async/staleness_mean"] == pytest.approx(2 / 3)
    assert stats["async/partial_groups"] == 1  # the [4, 5] group
    assert stats["buffer/size"] == 0


def test_buffer_with_zero_staleness_is_on_policy_and_waits_while_empty():
    q: queue.Queue = queue.Queue()
    q.put(_group(0, [[2]]))
    waits: list[int] = []

    def check_alive() -> None:  # runs while the buffer is empty: supply the missing group
        waits.append(1)
        q.put(_group(1, [[3]]))

    kept, stats = ExperienceBuffer(q, 0).take(1, 3, on_drop=lambda g: None, check_alive=check_alive, poll_s=0.01)
    assert [g.request_id for g in kept] == [1] and waits == [1] and stats["async/staleness_max"] == 0


def test_buffer_refuses_groups_dynamic_sampling_rejects_up_to_its_limit():
    """accept = has reward variance (the rewards ride on the rollouts): a stale group is dropped
    before it is judged; refused ones go to on_reject until max_rejects, then the batch fills."""
    from megatron_rl.algorithms.filters import has_reward_variance

    def scored(request_id: int, rewards: list[float], version: int = 5) -> ExperienceGroup:
        group = _group(request_id, [[version]] * len(rewards))
        for r, reward in zip(group.rollouts, rewards):
            r.reward = reward
        return group

    q: queue.Queue = queue.Queue()
    for g in [scored(0, [1, 1]), scored(1, [0, 1], version=2), scored(2, [0, 1]), scored(3, [0, 0]),
              scored(4, [1, 1]), scored(5, [1, 0]), scored(6, [0, 0])]:
        q.put(g)
    rejected: list[int] = []
    dropped: list[int] = []
    kept, stats = ExperienceBuffer(q, 1).take(
        3, 5, on_drop=lambda g: dropped.append(g.request_id), poll_s=0.01,
        accept=lambda g: has_reward_variance(torch.tensor([r.reward for r in g.rollouts])),
        on_reject=lambda g: rejected.append(g.request_id), max_rejects=3)
    assert dropped == [1] and rejected == [0, 3, 4]
    assert [g.request_id for g in kept] == [2, 5, 6]  # 6 has no variance but the limit was reached
    assert stats["dynamic_sampling/rejected"] == 3 and stats["dynamic_sampling/exhausted"] == 1
    q.put(scored(7, [0, 1]))
    _, stats = ExperienceBuffer(q, 1).take(1, 5, on_drop=lambda g: None, poll_s=0.01, accept=lambda g: True,
                                           max_rejects=3)
    assert stats["dynamic_sampling/rejected"] == 0 and stats["dynamic_sampling/exhausted"] == 0


def test_the_reward_counts_of_every_group_taken_reach_the_step():
    """A request's reward counts ride on its first group: they count whether the step keeps that group, drops
    it as stale, or dynamic sampling refuses it (a request whose rewards failed has no verdict: refused)."""
    q: queue.Queue = queue.Queue()
    counts = {"reward/verifier_calls": 1.0, "reward/failed_batches": 1.0, "reward/unscored": 2.0}
    stale, failed, good = _group(0, [[2]]), _group(1, [[5], [5]]), _group(2, [[5]])
    stale.rewards, failed.rewards = dict(counts), dict(counts)
    good.rewards = {"reward/verifier_calls": 1.0, "reward/answers": 1.0}
    for g in (stale, failed, good):
        q.put(g)
    kept, stats = ExperienceBuffer(q, 1).take(1, 5, on_drop=lambda g: None, poll_s=0.01,
                                              accept=lambda g: g.request_id == 2, max_rejects=3)
    assert [g.request_id for g in kept] == [2]
    assert {k: stats[k] for k in (*counts, "reward/answers")} == {
        "reward/verifier_calls": 3.0, "reward/failed_batches": 2.0, "reward/unscored": 4.0, "reward/answers": 1.0}


class CountingEngine:
    """Token t of a sequence is 100 + (its position); stops with token 0 at position `stop_at`
    of sequences whose prompt starts with 7. Log-prob of a token = -weight_version - 1."""

    def __init__(self, stop_at: int = 5) -> None:
        self.weight_version = 0
        self.stop_at = stop_at
        self.calls: list[tuple[int, int]] = []  # (sequences, max_new_tokens)

    def generate(self, prompts, params: SamplingParams) -> list[Generation]:
        out = []
        self.calls.append((len(prompts) * params.n, params.max_new_tokens))
        for index, prompt in enumerate(prompts):
            for _ in range(params.n):
                done = len(prompt) - 2 if prompt[0] == 7 else 0  # prompts here have 2 tokens
                tokens, reason = [], "length"
                for pos in range(done, done + params.max_new_tokens):
                    if prompt[0] == 7 and pos == self.stop_at:
                        tokens.append(0)
                        reason = "stop"
                        break
                    tokens.append(100 + pos)
                out.append(Generation(index, tokens, [-self.weight_version - 1.0] * len(tokens), reason,
                                      self.weight_version))
        return out


def test_partial_rollout_continues_across_a_weight_update_with_per_token_versions():
    engine = CountingEngine(stop_at=5)
    calls = []

    def between() -> None:  # the update lands after the first chunk
        calls.append(engine.weight_version)
        if len(calls) == 1:
            engine.weight_version = 1

    params = SamplingParams(max_new_tokens=7, n=2)
    gens = generate_partial(engine, [[7, 1], [8, 1]], params, chunk_tokens=3, between_chunks=between)
    assert len(gens) == 4 and [g.prompt_index for g in gens] == [0, 0, 1, 1]
    stopping, running = gens[0], gens[2]
    # prompt 7: tokens at positions 0..4, then the stop token at position 5 (chunks of 3: 3 + 3)
    assert stopping.output_ids == [100, 101, 102, 103, 104, 0] and stopping.finish_reason == "stop"
    assert stopping.token_versions == [0, 0, 0, 1, 1, 1]
    assert stopping.logprobs == [-1.0] * 3 + [-2.0] * 3
    assert stopping.weight_version == 0  # the oldest token's
    # prompt 8 never stops: 3 + 3 + 1 tokens (the budget), finish "length"
    assert len(running.output_ids) == 7 and running.finish_reason == "length"
    assert running.token_versions == [0, 0, 0, 1, 1, 1, 1]
    assert engine.calls == [(4, 3), (4, 3), (2, 1)]  # the stopped sequences are not continued
    assert calls == [0, 1]


def test_partial_rollouts_off_is_one_engine_call():
    engine = CountingEngine()
    gens = generate_partial(engine, [[8, 1]], SamplingParams(max_new_tokens=6, n=3), chunk_tokens=0,
                            between_chunks=lambda: pytest.fail("no chunk boundary without partial rollouts"))
    assert engine.calls == [(3, 6)] and all(g.token_versions == [0] * 6 for g in gens)


class RoutingEngine(CountingEngine):
    """CountingEngine that returns routing (rollout routing replay), one row per fed position, 2 layers of one
    expert: layer 0's is the prompt's index in the call, layer 1's 10 * weight version + the call's number."""

    def generate(self, prompts, params):
        gens = super().generate(prompts, params)
        for g in gens:
            rows = len(prompts[g.prompt_index]) + len(g.output_ids) - 1
            g.routing = torch.tensor([g.prompt_index, 10 * self.weight_version + len(self.calls)],
                                     dtype=torch.int16).view(1, 2, 1).repeat(rows, 1, 1)
        return gens


def test_whole_generations_keep_their_routing():
    """The engine's routing passes through a one-call request unchanged."""
    params = SamplingParams(max_new_tokens=4, n=2, return_routing=True)
    gens = generate_partial(RoutingEngine(), [[8, 1], [8, 2]], params, chunk_tokens=0)
    assert [tuple(g.routing.shape) for g in gens] == [(5, 2, 1)] * 4
    assert [int(g.routing[0, 0, 0]) for g in gens] == [0, 0, 1, 1]


def test_a_partial_rollouts_routing_keeps_each_position_as_the_call_that_sampled_its_next_token():
    """Chunks of 3 with a weight update after the first: a continuation routes the whole sequence again with
    the new weights, but the rows of the positions the first chunk fed (prompt, and its tokens but the last)
    stay the first call's; the rows the continuation adds are its own, so the routing has one row per fed
    position, [len(prompt) + len(output) - 1], like a whole generation's."""
    engine = RoutingEngine(stop_at=5)

    def between() -> None:  # the update lands at the first chunk boundary
        engine.weight_version = 1

    params = SamplingParams(max_new_tokens=7, n=1, return_routing=True)
    stopping, running = generate_partial(engine, [[7, 1], [8, 1]], params, chunk_tokens=3, between_chunks=between)
    # prompt 7: 2 prompt tokens, 3 tokens from version 0, then 3 from version 1 (the last the stop token)
    assert stopping.token_versions == [0, 0, 0, 1, 1, 1]
    assert stopping.routing[:, 1, 0].tolist() == [1] * 4 + [12] * 3  # rows 0-3 fed by call 1 (version 0)
    # prompt 8: 3 + 3 + 1 tokens; the third call's routing adds one row
    assert running.token_versions == [0, 0, 0, 1, 1, 1, 1]
    assert running.routing[:, 1, 0].tolist() == [1] * 4 + [12] * 3 + [13]
    assert running.routing[:4, 0, 0].tolist() == [1] * 4  # the first call's rows of prompt 8 (its index 1)
    assert all(g.routing.dtype == torch.int16 for g in (stopping, running))


def test_a_continuation_without_routing_is_an_error():
    class ForgetsOnContinuation(RoutingEngine):
        def generate(self, prompts, params):
            gens = super().generate(prompts, params)
            if len(prompts[0]) > 2:
                for g in gens:
                    g.routing = None
            return gens

    params = SamplingParams(max_new_tokens=6, n=1, return_routing=True)
    with pytest.raises(ValueError, match="without its routing"):
        generate_partial(ForgetsOnContinuation(), [[8, 1]], params, chunk_tokens=3)


def test_overlap_of_two_timelines_merges_each_side_first():
    generate = [(0.0, 1.0), (0.5, 2.0), (5.0, 6.0)]
    train = [(1.5, 3.0), (5.5, 7.0)]
    assert overlap_seconds(generate, train) == pytest.approx(0.5 + 0.5)
    assert overlap_seconds(generate, [(3.0, 4.0)]) == 0.0


def test_scheduler_metrics_sum_counts_and_weight_engine_busy_by_wall_time():
    """Two generators' scheduler runs: run A (4 s, engine busy half of it, 1 s held back by the
    sandbox) played groups a1, a2; run B (2 s, busy a quarter) played b1, one of whose episodes
    was kept partial. Counts and seconds add up over the groups a step takes; engine_busy is busy
    seconds over wall seconds (each group brings its equal share of its run's)."""
    from megatron_rl.disagg.buffer import scheduler_metrics, scheduler_shares
    from megatron_rl.rollout.multiturn import Episode

    def episodes(*statuses: str) -> list[Episode]:
        out = [Episode(0, [1], [], [], "stop", 0) for _ in statuses]
        for e, status in zip(out, statuses):
            e.status = status
        return out

    def run(wall: float, busy: float, waited: float) -> dict[str, float]:  # as run_episodes_async reports
        return {"sched/wall_s": wall, "sched/engine_busy": busy, "sched/backpressure_wait_s": waited,
                "sched/aborted": 0.0, "agent/turns_mean": 2.0}

    a = scheduler_shares(run(4.0, 0.5, 1.0), {0: episodes("submitted"), 1: episodes("submitted")})
    b = scheduler_shares(run(2.0, 0.25, 0.0), {0: episodes("partial", "max_turns")})
    a1, a2, b1 = (_group(i, [[0]]) for i in range(3))
    a1.sched, a2.sched, b1.sched = a[0], a[1], b[0]
    single_turn = _group(3, [[0]])  # completions carry no scheduler statistics
    got = scheduler_metrics([a1, a2, b1, single_turn])
    assert got == pytest.approx({"sched/engine_busy": (2.0 + 0.5) / 6.0, "sched/generator_wall_s": 6.0,
                                 "sched/backpressure_wait_s": 1.0, "sched/aborted": 0.0, "sched/deadline": 0.0,
                                 "sched/partial": 1.0})
    # a step that takes half of run A: half its seconds
    assert scheduler_metrics([a2, b1])["sched/engine_busy"] == pytest.approx((1.0 + 0.5) / 4.0)
    assert scheduler_metrics([single_turn]) == {} and scheduler_shares({}, {0: episodes("submitted")}) == {0: {}}
    # a joint run's agent domain: colocated mode's domain/<d>/ keys, kept apart from another domain's
    c = scheduler_shares(run(1.0, 1.0, 0.0), {0: episodes("submitted")}, "domain/cd/")
    c1 = _group(4, [[0]])
    c1.sched = c[0]
    got = scheduler_metrics([a1, c1])
    assert got["domain/cd/sched/engine_busy"] == 1.0 and got["sched/engine_busy"] == 0.5
    assert got["domain/cd/sched/generator_wall_s"] == 1.0 and got["sched/generator_wall_s"] == 2.0


@pytest.mark.parametrize("scheduler, partial", [("lockstep", 0), ("lockstep", 4), ("async", 4)],
                         ids=["updates_between_requests", "updates_between_turns", "async_scheduler"])
def test_a_generator_plays_agent_prompts_as_episodes(tmp_path, scheduler, partial):
    """`generator.serve` on an agent task (countdown: checked in-process, no sandbox) with a
    scripted policy that first answers with the task's known-bad expression, then with its
    reference: every episode takes two turns, the environment's answer between them is masked
    out of the loss, reward 1, and each group keeps its prompt's place and source index. With
    partial rollouts a pending weight update is applied before each turn (the scripted update
    bumps the version: turns at 1, then 2; the group is as old as its first turn); without,
    none lands inside the request. The async scheduler batches whatever turns are ready, so
    which call serves which turn varies; a second turn still comes from a later call than the
    first, with a newer version. Either scheduler's groups carry its statistics in equal
    shares: together, the engine-busy seconds of the `generate` calls (the updates before them
    left out)."""
    from megatron_rl.config import compose, to_typed
    from megatron_rl.data.domains import make_task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.disagg.controller import episode_stats
    from megatron_rl.disagg.events import EventLog, read_events
    from megatron_rl.disagg.generator import Request, serve
    from megatron_rl.envs import known_bad_turns, reference_turns
    from megatron_rl.rewards.service import RewardService
    from megatron_rl.rollout.multiturn import Episode, TurnFormat, task_system_prompt
    from megatron_rl.rollout.scripted import ScriptedPolicy

    cfg = to_typed(compose(["+experiment=demo_agent_countdown", "rollout.mode=disaggregated", "task.num_train=8",
                            "task.num_eval=2", f"rollout.partial_rollout_tokens={partial}",
                            f"rollout.agent_scheduler={scheduler}"]))
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    task = make_task(cfg, tokenizer)
    prompts = task.prompts("train")[:2]
    tasks = {p.meta["instruction"]: p.meta for p in prompts}
    assert len(tasks) == 2

    def turn(hook):  # the turn of whichever task the conversation is about
        return lambda text: hook("countdown", next(t for i, t in tasks.items() if i in text))[0]

    fmt = TurnFormat(tokenizer, task_system_prompt(cfg.task))
    policy = ScriptedPolicy(tokenizer, [turn(known_bad_turns), turn(reference_turns)], end_of_turn=fmt.end_of_turn)
    policy.weight_version = 0

    def update() -> None:
        policy.weight_version += 1

    rewards = RewardService(task.verifier_factory([]))
    events = EventLog(tmp_path / "generator0.jsonl")
    request = Request(7, [3, 5], [(list(p.tokens), dict(p.meta)) for p in prompts],
                      SamplingParams(max_new_tokens=16, n=2, seed=1, stop_token_ids=task.stop_token_ids))
    try:
        groups = serve(cfg, 0, request, task, policy, rewards, tokenizer, update, events)
    finally:
        rewards.close()
        events.close()
    generate = [e for e in read_events(tmp_path / "generator0.jsonl") if e["event"] == "generate"]
    lockstep = scheduler == "lockstep"
    turns = [1, 2] if partial else [0, 0]
    assert [(g.request_id, g.generator, len(g.rollouts)) for g in groups] == [(7, 0, 2), (7, 0, 2)]
    for position, (group, prompt) in enumerate(zip(groups, prompts)):
        meta = prompt.meta
        if lockstep:
            assert (group.version, group.versions) == (turns[0], sorted(set(turns)))
        else:
            assert group.version == min(ep.turn_versions[0] for ep in group.rollouts)
        for ep in group.rollouts:
            assert isinstance(ep, Episode) and (ep.prompt_index, ep.source_index) == (position, [3, 5][position])
            assert (ep.reward, ep.status, ep.num_turns, ep.weight_version) == (1.0, "submitted", 2, ep.turn_versions[0])
            if lockstep:
                assert ep.turn_versions == turns
            else:
                assert 1 <= ep.turn_versions[0] < ep.turn_versions[1] <= len(generate)
            model = tokenizer.decode([t for t, m in zip(ep.output_ids, ep.model_mask) if m])
            eot = fmt.end_of_turn
            assert model == known_bad_turns("countdown", meta)[0] + eot + reference_turns("countdown", meta)[0] + eot
            assert 0 in ep.model_mask and ep.prompt_tokens == fmt.encode(fmt.prompt(meta["instruction"]))
    stats = episode_stats(task, [ep for g in groups for ep in g.rollouts])
    assert (stats["agent/turns_mean"], stats["agent/submitted"], stats["agent/env/solved"]) == (2.0, 4.0, 1.0)
    if lockstep:
        assert [(e["request"], e["sequences"], e["version"]) for e in generate] == [(7, 4, v) for v in turns]
    else:  # one version per call: the update before it
        assert [e["version"] for e in generate] == list(range(1, len(generate) + 1))
        assert sum(e["sequences"] for e in generate) == 8 and all(e["request"] == 7 for e in generate)
    shares = [g.sched for g in groups]
    assert shares[0]["sched/generator_wall_s"] == shares[1]["sched/generator_wall_s"] > 0  # equal shares
    assert all(s["sched/partial"] == s["sched/aborted"] == s["sched/deadline"] == 0 for s in shares)
    busy = sum(s["sched/engine_busy_s"] for s in shares)
    assert busy == pytest.approx(sum(e["end"] - e["start"] for e in generate), rel=0.2, abs=0.05)


def test_a_joint_request_completes_single_turn_prompts_and_plays_agent_ones(tmp_path):
    """A joint run's request mixes domains: `serve` completes the math domain's prompts (one
    engine call, rule rewards, a version per token) and plays the countdown domain's as
    episodes in that domain's environments; every group keeps its prompt's place and domain."""
    from megatron_rl.config import compose, to_typed
    from megatron_rl.data.domains import make_task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.disagg.events import EventLog
    from megatron_rl.disagg.generator import Request, serve
    from megatron_rl.envs import reference_turns
    from megatron_rl.rewards.service import RewardService
    from megatron_rl.rollout.multiturn import Episode
    from megatron_rl.rollout.scripted import ScriptedPolicy

    domains = ("+domains={math:{task:{type:arithmetic,num_train:4,num_eval:1}},"
               "cd:{task:{type:agent,generator:countdown,environment:countdown,num_train:4,num_eval:1,max_turns:2}}}")
    cfg = to_typed(compose(["+experiment=demo_countdown", domains, "rollout.mode=disaggregated"]))
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    task = make_task(cfg, tokenizer)
    prompts = task.prompts("train")
    math = next(p for p in prompts if p.meta["domain"] == "math")
    agent = next(p for p in prompts if p.meta["domain"] == "cd")
    solution, boxed = reference_turns("countdown", agent.meta)[0], f"\\boxed{{{math.meta['answer']}}}"

    class Policy(ScriptedPolicy):  # math prompts are plain text, not chat turns: they get turn 0 as well
        def _turn_index(self, prompt):
            return max(super()._turn_index(prompt), 0)

    policy = Policy(tokenizer, [lambda text: solution if agent.meta["instruction"] in text else boxed])
    rewards = RewardService(task.verifier_factory([]))
    events = EventLog(tmp_path / "generator0.jsonl")
    order = [agent, math]  # positions 0 and 1 of the request, source indices 10 and 11
    request = Request(1, [10, 11], [(list(p.tokens), dict(p.meta)) for p in order],
                      SamplingParams(max_new_tokens=16, n=2, seed=1, stop_token_ids=task.stop_token_ids))
    stamps: list[str] = []
    calls = policy.generate

    def generate(prompts, params):  # the generator's progress clock is stamped around every engine call
        stamps.append("call")
        return calls(prompts, params)

    policy.generate = generate
    try:
        groups = serve(cfg, 0, request, task, policy, rewards, tokenizer, lambda: None, events,
                       progress=lambda: stamps.append("progress"))
    finally:
        rewards.close()
        events.close()
    assert stamps.count("call") >= 2 and "call" not in {stamps[0], stamps[-1]}
    assert all(stamps[i - 1] == stamps[i + 1] == "progress" for i, s in enumerate(stamps) if s == "call")
    played, completed = groups
    assert all(isinstance(r, Episode) and (r.domain, r.source_index, r.prompt_index, r.reward, r.num_turns) ==
               ("cd", 10, 0, 1.0, 1) for r in played.rollouts)
    assert len(played.rollouts) == len(completed.rollouts) == 2
    for r, versions in zip(completed.rollouts, completed.token_versions):
        assert not isinstance(r, Episode) and (r.domain, r.source_index, r.prompt_index) == ("math", 11, 1)
        assert r.prompt_tokens == list(math.tokens) and tokenizer.decode(r.output_ids) == boxed
        assert versions == [0] * len(r.output_ids) and r.reward == 1.0  # the right answer, boxed


def test_a_bounded_wait_stamps_progress_while_it_waits():
    """The reward wait of a request is waited for in rounds that stamp the generator's progress
    clock: it is bounded (its own timeout), so no hang."""
    import concurrent.futures

    from megatron_rl.disagg.generator import _result

    stamps: list[float] = []
    late: concurrent.futures.Future = concurrent.futures.Future()

    def stamp() -> None:  # the result arrives during the third round: no timing involved
        stamps.append(1.0)
        if len(stamps) == 3:
            late.set_result([1.0])

    assert _result(late, 5.0, stamp, poll_s=0.1) == [1.0]
    assert len(stamps) == 3
    never: concurrent.futures.Future = concurrent.futures.Future()
    with pytest.raises(concurrent.futures.TimeoutError):
        _result(never, 0.25, lambda: None, poll_s=0.1)


def _cfg(overrides: list[str]):
    from megatron_rl.config import compose, to_typed

    return to_typed(compose(["+experiment=demo_countdown", "task=arithmetic", *overrides]))


@pytest.mark.parametrize("overrides, message", [
    (["rollout.partial_rollout_tokens=4"], "rollout.partial_rollout_tokens=4 is invalid: is a disaggregated-mode"),
    (["rollout.num_generators=2"], "rollout.num_generators=2 is invalid"),
    (["rollout.mode=remote"], "rollout.mode=remote is invalid: allowed values are colocated, disaggregated"),
    (["algorithm.max_staleness=-1"], "algorithm.max_staleness=-1 is invalid: must be >= 0"),
    (["rollout.generator_nodes=1"], "rollout.generator_nodes=1 is invalid: is a disaggregated-mode setting"),
    (["rollout.mode=disaggregated", "rollout.generator_nodes=2", "rollout.num_generators=3"],
     "rollout.num_generators=3 is invalid: must be a multiple of rollout.generator_nodes=2"),
    (["rollout.mode=disaggregated", "rollout.generator_timeout_s=0"], "rollout.generator_timeout_s=0"),
    (["rollout.mode=disaggregated", "rollout.generator_progress_timeout_s=0"],
     "rollout.generator_progress_timeout_s=0 is invalid: must be > 0"),
])
def test_schema_refuses_disaggregated_settings_it_cannot_use(overrides, message):
    with pytest.raises(Exception, match=message.replace("(", r"\(")):
        _cfg(overrides)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.max_staleness=2"], "applies to rollout.mode=disaggregated only"),
    (["rollout.mode=disaggregated", "algorithm.old_logprobs=rollout"], "need the trainer.s log-probs"),
    (["rollout.mode=disaggregated", "rollout.step_deadline_s=30"],
     "rollout.step_deadline_s=30.* is a colocated-mode setting .* the experience buffer takes groups as they finish"),
    (["rollout.mode=disaggregated", "rollout.agent_scheduler=async", "rollout.oversample=0.5"],
     "rollout.oversample=0.5 is a colocated-mode setting"),
])
def test_cross_group_checks(overrides, message):
    from megatron_rl.config import ConfigError
    from megatron_rl.config.checks.run import check_disaggregated_config

    with pytest.raises(ConfigError, match=message):
        check_disaggregated_config(_cfg(overrides))


def test_disaggregated_defaults_pass_and_colocated_is_the_default():
    from megatron_rl.config.checks.run import check_disaggregated_config

    cfg = _cfg([])
    assert cfg.rollout.mode == "colocated" and cfg.rollout.partial_rollout_tokens == 0
    check_disaggregated_config(cfg)
    check_disaggregated_config(_cfg(["rollout.mode=disaggregated", "rollout.partial_rollout_tokens=4",
                                     "algorithm.max_staleness=0"]))
    assert dataclasses.is_dataclass(cfg.rollout)
