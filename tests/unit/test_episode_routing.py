"""Rollout routing replay (algorithm.routing_replay=rollout) in agent episodes: every turn's engine call feeds
the whole episode so far, so the last call's routing covers every token up to that turn's last; the episode
keeps it (cut with the turn at the episode's token budget), its sample carries it, -1 marking positions no
engine call routed, which the trainer's routers then route (`routing_replay.carried_routes`), and a batch's
rollouts that never reached the engine get routing that covers nothing."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.rollout.base import Generation, SamplingParams
from megatron_rl.rollout.collect import Rollout, uncovered_routing
from megatron_rl.rollout.multiturn import Episode, EpisodeLimits, TurnFormat, run_episodes, take_turn
from megatron_rl.rollout.scheduler import run_episodes_async
from megatron_rl.rollout.scripted import ScriptedPolicy
from megatron_rl.trainer.routing_replay import carried_routes


def _routing(call: int, fed: int) -> torch.Tensor:
    """[fed, 1 MoE layer, top 2]: (the engine call's number, the position mod 4) for every position fed."""
    return torch.stack([torch.full((fed,), call), torch.arange(fed) % 4], dim=1).reshape(fed, 1, 2).to(torch.int16)


class RoutingPolicy(ScriptedPolicy):
    """Scripted turns; each generation routes what its call fed (`_routing`, numbered by call)."""

    calls = 0

    def generate(self, prompts, params):
        assert params.return_routing
        gens = super().generate(prompts, params)
        for g in gens:
            g.routing = _routing(self.calls, len(prompts[g.prompt_index]) + len(g.output_ids) - 1)
        self.calls += 1
        return gens


class EchoEnv:
    async def reset(self, task):
        pass

    async def step(self, action):
        return "ok", False

    async def evaluate(self):
        return 0.0

    async def close(self):
        pass


@pytest.mark.parametrize("driver", ["lockstep", "async"])
def test_an_episode_carries_its_last_calls_routing_of_every_token(driver, loop):
    tokenizer = load_tokenizer("builtin:char")
    fmt = TurnFormat(tokenizer, "sys")
    policy = RoutingPolicy(tokenizer, ["abc", "de", "fgh"], end_of_turn=fmt.end_of_turn)
    params, limits = SamplingParams(max_new_tokens=16, return_routing=True), EpisodeLimits(3, 500, 60)
    if driver == "lockstep":
        [episode] = run_episodes(policy, [{"instruction": "a"}], 1, params, EchoEnv, fmt, limits, loop)
    else:
        [episode], _ = run_episodes_async(policy, [{"instruction": "a"}], 1, params, EchoEnv, fmt, limits, loop)
    assert episode.num_turns == 3 and policy.calls == 3 and episode.status == "max_turns"
    sample = episode.sample({})
    targets = len(sample.tokens) - 1
    assert tuple(episode.routing.shape) == (targets, 1, 2)
    assert torch.equal(sample.extras["routing"], _routing(2, targets).reshape(targets, 2))  # the last call's


def test_a_turn_cut_at_the_token_budget_cuts_its_routing():
    tokenizer = load_tokenizer("builtin:char")
    fmt = TurnFormat(tokenizer, "s")
    prompt = fmt.encode(fmt.prompt("task"))
    episode = Episode(0, list(prompt), [], [], "stop", 0)
    limits = EpisodeLimits(max_turns=4, max_tokens=len(prompt) + 3, wall_time_s=60)
    ids = [5, 6, 7, 8, 9]
    take_turn(episode, Generation(0, ids, [0.0] * 5, "length", 0, routing=_routing(0, len(prompt) + 4)), fmt, limits)
    assert episode.output_ids == ids[:3]
    assert torch.equal(episode.routing, _routing(0, len(prompt) + 2))


def test_positions_no_call_routed_are_marked_and_left_to_the_trainers_routers():
    # an episode whose routing stops two positions short of its targets
    episode = Episode(0, [1, 2, 3], [4, 5, 6, 7], [0.0] * 4, "stop", 0, model_mask=[1, 1, 0, 0],
                      routing=_routing(0, 4))
    routing = episode.sample({}).extras["routing"]
    assert tuple(routing.shape) == (6, 2)
    assert torch.equal(routing[:4], _routing(0, 4).reshape(4, 2)) and (routing[4:] == -1).all()
    # packed into a row of 8 positions from offset 1: covered where the engine routed, routed freely elsewhere
    mb = types.SimpleNamespace(input_ids=torch.zeros(1, 8, dtype=torch.long), valid=torch.arange(1, 7),
                               extras={"routing": routing.float()})  # the packer's extras are float
    [experts], covered = carried_routes(mb, [0], num_moe_layers=1, topk=2)
    assert covered.tolist() == [False, True, True, True, True, False, False, False]
    assert torch.equal(experts[1:5], _routing(0, 4).reshape(4, 2).long()) and (experts[5:7] >= 0).all()


def test_rollouts_that_never_reached_the_engine_get_routing_that_covers_nothing():
    routed = Rollout(0, [1, 2], [3, 4], [0.0, 0.0], "stop", 0, routing=_routing(0, 3))
    unrouted = Episode(1, [1, 2, 3], [], [], "stop", 0, status="max_tokens")
    plain = Rollout(2, [1], [2], [0.0], "stop", 0)
    uncovered_routing([routed, unrouted, plain])
    assert torch.equal(routed.routing, _routing(0, 3))
    assert tuple(unrouted.routing.shape) == (2, 1, 2) and (unrouted.routing == -1).all()
    assert tuple(plain.routing.shape) == (1, 1, 2) and (plain.routing == -1).all()
    no_routing = [Rollout(0, [1], [2], [0.0], "stop", 0)]
    uncovered_routing(no_routing)
    assert no_routing[0].routing is None
