"""Agent tasks as domains of a joint run: what the config checks refuse before start-up, how
`MultiTask` lists its agent domains, and `task.reward_scale` reaching an environment's reward."""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.checks.run import check_run

AGENT = "code:{task:{type:agent,generator:function,num_train:4,num_eval:2,max_episode_tokens:%d}}"


def _joint(*overrides: str, tokens: int = 400):
    domains = "+domains={math:{task:{type:arithmetic,num_train:8,num_eval:2}}," + AGENT % tokens + "}"
    return load_config(["mode=rl", domains, *overrides], world_size=1)


def test_an_agent_domain_passes_the_run_checks():
    check_run(_joint())
    check_run(_joint("rollout.mode=disaggregated"))  # the generators play its episodes
    check_run(_joint("rollout.oversample=0.5", "rollout.agent_scheduler=async"))  # cut to shares


@pytest.mark.parametrize("sizes, total, expected", [
    ([3, 3], 4, [2, 2]), ([4, 2], 4, [3, 1]), ([5, 1], 4, [3, 1]), ([1, 1, 1], 2, [1, 1, 0]),
    ([2, 0], 4, [2, 0]), ([0, 0], 3, [0, 0]), ([7], 5, [5]),
])
def test_oversampled_groups_are_shared_out_in_proportion(sizes, total, expected):
    """A joint run's over-sampled prompts, per part (the single-turn domains, each agent domain):
    each keeps its proportional share of the batch's groups (largest remainders)."""
    from megatron_rl.rollout.colocated import apportion

    got = apportion(sizes, total)
    assert got == expected
    assert sum(got) == min(total, sum(sizes)) and all(0 <= g <= s for g, s in zip(got, sizes))


@pytest.mark.parametrize("overrides, tokens, message", [
    ([], 100_000, r"domains.code.task.max_episode_tokens=100000 must be <= the model's context "
                  r"\(\d+: model.max_position_embeddings"),
    (["micro_batch_tokens=256"], 400, r"domains.code.task.max_episode_tokens=400 must be <= micro_batch_tokens=256"),
])
def test_what_an_agent_domain_cannot_run_with_is_refused(overrides, tokens, message):
    with pytest.raises(ConfigError, match=message):
        check_run(_joint(*overrides, tokens=tokens))


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


def test_groups_finished_beyond_a_domains_share_are_cut():
    """Episodes that finish together with the share's last group: the later groups are cut whole
    (already cut or past the deadline do not count towards the share)."""
    from types import SimpleNamespace

    from megatron_rl.rollout.colocated import cut_beyond

    statuses = {0: "submitted", 1: "aborted", 2: "max_turns", 3: "deadline", 4: "submitted", 5: "submitted"}
    rollouts = [SimpleNamespace(prompt_index=g, status=s, reward=1.0) for g, s in statuses.items() for _ in range(2)]
    cut_beyond(rollouts, 2)
    kept = sorted({r.prompt_index for r in rollouts if r.status not in ("aborted", "deadline")})
    assert kept == [0, 2]
    assert all(r.status == "aborted" and r.reward == 0.0 for r in rollouts if r.prompt_index in (4, 5))
    assert [r.status for r in rollouts if r.prompt_index == 3] == ["deadline"] * 2


def test_a_group_finished_beside_the_batchs_last_is_cut_in_a_single_task_run(monkeypatch):
    """Over-sampling without domains (6 groups drawn for a batch of 4): when a fifth group finishes in
    the same turn of the event loop as the fourth (the scheduler then returns 5 complete groups;
    CI saw it), or on another data-parallel rank, the batch is still exactly its 4 groups and the
    others are cut (counted in sched/groups_cut)."""
    from types import SimpleNamespace

    from megatron_rl.rollout import episodes
    from megatron_rl.rollout.colocated import Generation

    cfg = load_config(["mode=rl", "task.type=agent", "global_batch_size=8", "rollout.n_samples_per_prompt=2",
                       "rollout.agent_scheduler=async", "rollout.oversample=0.5", "task.max_episode_tokens=500"],
                      world_size=1)
    seen = {}

    def collect_episodes(engine, prompts, params, rewards, groups, fmt, limits, scheduler, concurrency, target,
                         *rest):
        seen["target"] = target
        status = ["submitted"] * 5 + ["aborted"]  # group 5 still running at the cut
        return [SimpleNamespace(prompt_index=g, status=s, reward=float(s != "aborted")) for g, s in enumerate(status)
                for _ in range(2)], {}

    monkeypatch.setattr(episodes, "collect_episodes", collect_episodes)
    monkeypatch.setattr(Generation, "turn_format", lambda self, task_cfg: None)
    gen = Generation(cfg, None, None, None, None, None, SimpleNamespace(timeline=None))
    prompts = [SimpleNamespace(meta={}) for _ in range(6)]
    got, _ = gen.episodes(prompts, SimpleNamespace(n=2), cfg.task, None, training=True)
    assert seen["target"] == 4
    assert sorted({r.prompt_index for r in got if r.status != "aborted"}) == [0, 1, 2, 3]
    assert all(r.reward == 0.0 for r in got if r.prompt_index >= 4)
    got, _ = gen.episodes(prompts, SimpleNamespace(n=2), cfg.task, None, training=False)
    assert seen["target"] is None and sum(r.status != "aborted" for r in got) == 10  # evaluation cuts nothing
