"""Agent tasks as domains of a joint run: what the config checks refuse before start-up, how
`MultiTask` lists its agent domains, and `task.reward_scale` reaching an environment's reward."""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.train import check_train_config

AGENT = "code:{task:{type:agent,generator:function,num_train:4,num_eval:2,max_episode_tokens:%d}}"


def _joint(*overrides: str, tokens: int = 400):
    domains = "+domains={math:{task:{type:math,num_train:8,num_eval:2}}," + AGENT % tokens + "}"
    return load_config(["mode=rl", domains, *overrides], world_size=1)


def test_an_agent_domain_passes_the_run_checks():
    check_train_config(_joint())
    check_train_config(_joint("rollout.mode=disaggregated"))  # the generators play its episodes


@pytest.mark.parametrize("overrides, tokens, message", [
    (["rollout.oversample=0.5", "rollout.agent_scheduler=async"], 400,
     r"rollout.oversample=0.5 cuts straggling agent episodes.*agent domains: domains.code.task"),
    ([], 100_000, r"domains.code.task.max_episode_tokens=100000 must be <= model.max_position_embeddings"),
])
def test_what_an_agent_domain_cannot_run_with_is_refused(overrides, tokens, message):
    with pytest.raises(ConfigError, match=message):
        check_train_config(_joint(*overrides, tokens=tokens))


def test_multitask_lists_its_agent_domains_and_tags_their_prompts():
    from megatron_rl.data.domains import MultiTask
    from megatron_rl.data.tokenizer import load_tokenizer

    cfg = _joint()
    task = MultiTask(cfg.domains, load_tokenizer(cfg.model.tokenizer))
    assert task.agent_domains == ("code",) and not task.is_agent
    prompts = task.prompts("train")
    agent = [p for p in prompts if p.meta["domain"] == "code"]
    assert len(agent) == 4 and all(p.meta.get("instruction") and p.meta.get("reference") for p in agent)
    assert len(prompts) == 8 + 4


class _Env:
    async def evaluate(self) -> float:
        return 0.75

    turns = 3


class _Host:
    calls = 0

    def make_env(self):
        return _Env()


def test_reward_scale_multiplies_an_environments_reward():
    from megatron_rl.data.tasks import ScaledVerifier

    env = ScaledVerifier(_Host(), 4.0).make_env()
    assert asyncio.run(env.evaluate()) == 3.0 and env.turns == 3  # the rest is the environment's own
