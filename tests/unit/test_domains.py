"""Multi-domain joint training, data side: the `domains` config and its errors, the joint task
(prompts tagged by domain, rewards dispatched to each domain's verifier, reward_scale) and
the mixture sampler (shares by weight, determinism, exact resume, pausing)."""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl.config import ConfigError, DomainConfig, TaskConfig, TrainConfig, load_config
from megatron_rl.data.domains import MixtureSampler, MultiTask, make_sampler, make_task
from megatron_rl.data.sampler import EpochSampler
from megatron_rl.data.tasks import Task
from megatron_rl.data.tokenizer import load_tokenizer

TWO = "+domains={a:{weight:3,task:{type:arithmetic,num_train:6,num_eval:2}},b:{task:{type:arithmetic,seed:1,num_train:4}}}"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:char")


# ---- config


def test_domains_compose_from_overrides_and_the_experiment_yaml():
    cfg = load_config(["mode=rl", TWO, "domains.b.task.reward_scale=10"], world_size=1)
    assert list(cfg.domains) == ["a", "b"]
    assert (cfg.domains["a"].weight, cfg.domains["b"].weight) == (3.0, 1.0)
    assert cfg.domains["b"].task.reward_scale == 10.0 and cfg.domains["a"].task.num_train == 6
    joint = load_config(["+experiment=joint_countdown_math"], world_size=1)
    assert {n: (d.task.type, d.weight) for n, d in joint.domains.items()} == {"countdown": ("countdown", 2.0),
                                                                           "math": ("arithmetic", 1.0)}
    assert joint.algorithm.domain_calibration == "running"
    assert load_config(["mode=rl"], world_size=1).domains == {}  # default: the single-task run


@pytest.mark.parametrize("overrides, match", [
    (["+domains={a:{weight:0},b:{}}"], r"^domains\.a\.weight=0 is invalid: must be > 0"),
    (["+domains={a:{weight:-1.5},b:{}}"], r"^domains\.a\.weight=-1.5 is invalid"),
    (["+domains={a:{}}"], r"^domains=a is invalid: a joint run needs >= 2 domains"),
    (["+domains={a:{task:{type:maths}},b:{}}"], r"^domains\.a\.task\.type=maths is invalid: allowed values are "
                                                r"countdown, arithmetic, dataset.*set domains\.a\.task\.type="),
    (["+domains={a:{task:{reward_scale:0}},b:{}}"], r"^domains\.a\.task\.reward_scale=0 is invalid: must be > 0"),
    (["+domains={a:{wieght:1},b:{}}"], r"unknown key domains\.a\.wieght"),
    (["+domains={a.b:{},c:{}}"], r"letters, digits"),
    (["algorithm.domain_calibration=running"], r"^algorithm\.domain_calibration=running is invalid: needs a "
                                               r"multi-domain run"),
    (["algorithm.domain_pause_window=10"], r"^algorithm\.domain_pause_window=10 is invalid"),
    (["algorithm.domain_calibration=zscore"], r"allowed values are none, running"),
    (["algorithm.domain_calibration_momentum=0"], r"momentum=0 is invalid: must lie in \(0, 1\]"),
    ([TWO, "algorithm.domain_pause_window=10", "task.eval_every=0"], r"^task\.eval_every=0 is invalid: pausing"),
    ([TWO, "algorithm.domain_pause_window=10", "domains.b.task.num_eval=0"], r"^domains\.b\.task\.num_eval=0"),
])
def test_bad_domain_settings_fail_with_the_key_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_config(["mode=rl", *overrides], world_size=1)
    assert "\n" not in str(err.value)


def test_domains_are_an_rl_feature():
    with pytest.raises(ValueError, match="^mode=sft is invalid: domains are mixed by the RL loop only"):
        TrainConfig(mode="sft", domains={"a": DomainConfig(), "b": DomainConfig()})


# ---- the joint task


def _joint(tokenizer, scale_b: float = 1.0) -> MultiTask:
    return MultiTask({"a": DomainConfig(TaskConfig(chat_template=False, name="a", type="arithmetic", num_train=5, num_eval=2), weight=2.0),
                      "b": DomainConfig(TaskConfig(chat_template=False, name="b", type="arithmetic", seed=1, num_train=3, num_eval=2,
                                                   reward_scale=scale_b))}, tokenizer)


def test_prompts_are_tagged_with_their_domain_in_config_order(tokenizer):
    task = _joint(tokenizer)
    train = task.prompts("train")
    assert [p.meta["domain"] for p in train] == ["a"] * 5 + ["b"] * 3
    alone = Task(TaskConfig(chat_template=False, type="arithmetic", seed=1, num_train=3), tokenizer).prompts("train")
    assert [p.text for p in train[5:]] == [p.text for p in alone]
    assert all("domain" not in p.meta for p in alone)  # the domain tasks' own prompts are not modified
    assert [p.meta["domain"] for p in task.prompts("eval")] == ["a", "a", "b", "b"]
    assert not task.needs_sandbox and task.stop_token_ids == ()


def test_the_verifier_sends_each_item_to_its_domain_and_scales_its_reward(tokenizer):
    task = _joint(tokenizer, scale_b=10.0)
    train = task.prompts("train")
    right = lambda p: f"\\boxed{{{p.meta['answer']}}}"  # noqa: E731
    items = [(train[5].meta, right(train[5])), (train[0].meta, right(train[0])), (train[6].meta, "\\boxed{-1}"),
             (train[1].meta, "no answer"), (train[7].meta, right(train[7]))]
    verifier = task.verifier_factory([])()
    assert asyncio.run(verifier.score(items)) == [10.0, 1.0, 0.0, 0.0, 10.0]
    assert verifier.calls == 2 and verifier.errors == 0  # one batch per domain
    assert verifier.client is None  # nothing to close for rule verifiers
    assert [task.reward_scale_of(p.meta) for p in (train[0], train[5])] == [1.0, 10.0]
    with pytest.raises(ValueError, match="item 0 has domain 'c'"):
        asyncio.run(verifier.score([({"domain": "c", "answer": "1"}, "1")]))


def test_reward_scale_applies_to_a_single_task_too(tokenizer):
    task = Task(TaskConfig(chat_template=False, type="arithmetic", num_train=2, reward_scale=4.0), tokenizer)
    prompt = task.prompts("train")[0]
    verifier = task.verifier_factory([])()
    assert asyncio.run(verifier.score([(prompt.meta, f"\\boxed{{{prompt.meta['answer']}}}")])) == [4.0]
    assert verifier.calls == 1 and verifier.kind == "math"  # the inner verifier's attributes show through


def test_make_task_and_make_sampler_keep_the_single_task_path(tokenizer):
    single = load_config(["mode=rl", "task=arithmetic", "task.num_train=4"], world_size=1)
    task = make_task(single, tokenizer)
    assert type(task) is Task
    assert type(make_sampler(task, task.prompts("train"), seed=3)) is EpochSampler
    joint = load_config(["mode=rl", TWO], world_size=1)
    task = make_task(joint, tokenizer)
    sampler = make_sampler(task, task.prompts("train"), seed=3)
    assert isinstance(task, MultiTask) and isinstance(sampler, MixtureSampler)
    assert sampler.sizes == {"a": 6, "b": 4} and sampler.offsets == {"a": 0, "b": 6}


# ---- the mixture sampler


def test_each_call_splits_by_weight_and_the_remainders_carry_over():
    sampler = MixtureSampler({"a": 100, "b": 100}, {"a": 2.0, "b": 1.0}, seed=0)
    # 4 draws at shares 2/3, 1/3, each to the domain furthest behind: quotas 2.67 / 1.33 -> a, a, b, a
    # (3 / 1, carry -0.33 / +0.33); 2.33 / 1.67 -> a, b, a, b (2 / 2, carry 0.33 / -0.33); 3 / 1 -> 3 / 1.
    counts = [sampler.allocate(4) for _ in range(3)]
    assert counts == [{"a": 3, "b": 1}, {"a": 2, "b": 2}, {"a": 3, "b": 1}]
    assert sum(c["a"] for c in counts) == 8 and sum(c["b"] for c in counts) == 4  # exactly 2:1 over 12 draws


def test_long_run_shares_match_the_weights_to_within_one_draw():
    weights = {"a": 1.0, "b": 2.5, "c": 0.5}
    sampler = MixtureSampler({"a": 7, "b": 5, "c": 3}, weights, seed=1)
    totals = {n: 0 for n in weights}
    for step in range(1, 200):
        for n, c in sampler.allocate(3).items():
            totals[n] += c
        for n, w in weights.items():
            assert abs(totals[n] - 3 * step * w / 4.0) < 1.0 + 1e-9


def test_indices_point_into_each_domains_block_and_cover_it_every_epoch():
    sampler = MixtureSampler({"a": 4, "b": 2}, {"a": 2.0, "b": 1.0}, seed=5)
    drawn = [sampler.next_batch(3) for _ in range(4)]  # 8 draws of a, 4 of b = 2 epochs each
    flat = [i for batch in drawn for i in batch]
    assert sorted(i for i in flat if i < 4) == sorted(list(range(4)) * 2)
    assert sorted(i for i in flat if i >= 4) == [4, 4, 5, 5]
    again = MixtureSampler({"a": 4, "b": 2}, {"a": 2.0, "b": 1.0}, seed=5)
    assert [again.next_batch(3) for _ in range(4)] == drawn  # deterministic
    other = MixtureSampler({"a": 4, "b": 2}, {"a": 2.0, "b": 1.0}, seed=6)
    assert [other.next_batch(3) for _ in range(4)] != drawn


def test_resume_continues_the_same_draws_including_pauses():
    a = MixtureSampler({"a": 9, "b": 7, "c": 5}, {"a": 1.0, "b": 1.0, "c": 2.0}, seed=2)
    for _ in range(3):
        a.next_batch(5)
    a.pause("c")
    a.next_batch(5)
    state = a.state_dict()
    expected = [a.next_batch(5) for _ in range(6)]
    b = MixtureSampler({"a": 9, "b": 7, "c": 5}, {"a": 1.0, "b": 1.0, "c": 2.0}, seed=2)
    b.load_state_dict(state)
    assert b.paused == ["c"] and [b.next_batch(5) for _ in range(6)] == expected
    with pytest.raises(ValueError, match="this run has"):
        MixtureSampler({"a": 9, "b": 8, "c": 5}, {"a": 1.0, "b": 1.0, "c": 2.0}, seed=2).load_state_dict(state)


def test_a_paused_domain_is_not_drawn_and_the_others_share_by_renormalised_weights():
    sampler = MixtureSampler({"a": 10, "b": 10, "c": 10}, {"a": 1.0, "b": 1.0, "c": 2.0}, seed=0)
    sampler.next_batch(3)
    sampler.pause("c")
    assert sampler.mixture() == {"a": 0.5, "b": 0.5, "c": 0.0}
    for _ in range(5):
        batch = sampler.next_batch(4)
        assert all(i < 20 for i in batch) and sum(i < 10 for i in batch) == 2
    sampler.pause("b")
    with pytest.raises(ValueError, match="'a' is the last active domain"):
        sampler.pause("a")
    assert all(i < 10 for i in sampler.next_batch(4))


def test_for_prompts_needs_contiguous_domains(tokenizer):
    prompts = _joint(tokenizer).prompts("train")
    with pytest.raises(ValueError, match="'a' prompts are not contiguous"):
        MixtureSampler.for_prompts(prompts + prompts[:1], {"a": 1.0, "b": 1.0}, seed=0)
    with pytest.raises(ValueError, match="domains c have no training prompts"):
        MixtureSampler.for_prompts(prompts, {"a": 1.0, "b": 1.0, "c": 1.0}, seed=0)


def test_dynamic_sampling_keeps_the_mixture_of_the_groups_it_trains_on():
    """Two domains of weight 1 whose groups carry a signal alike (3 of every 4 prompts, by index): the groups a
    colocated step with dynamic sampling trains on are half of each. The round that fills the batch has a
    surplus, and cutting it from the end of the prompt order (domain after domain) took it from b alone."""
    import types
    from collections import Counter

    from megatron_rl.rollout.collect import Rollout
    from megatron_rl.rollout.colocated import ColocatedSource

    sizes, n = {"a": 400, "b": 400}, 2
    sampler = MixtureSampler(sizes, {"a": 1.0, "b": 1.0}, seed=0)
    prompts = [types.SimpleNamespace(meta={"domain": d}, index=i)
               for d in sizes for i in range(sizes[d])]

    def generate(batch, params, training=False):  # a group varies (rewards 1, 0) unless its row index is 0 mod 4
        return [Rollout(i, [1], [2], [0.0], "stop", 0, reward=float(k == 0 and p.index % 4 != 0),
                        domain=p.meta["domain"]) for i, p in enumerate(batch) for k in range(n)], {}

    controller = types.SimpleNamespace(rollout=lambda run: run(), metrics=lambda: {}, timeline=None)
    cfg = types.SimpleNamespace(algorithm=types.SimpleNamespace(dynamic_sampling=True, dynamic_sampling_max_rounds=4),
                                rollout=types.SimpleNamespace(n_samples_per_prompt=n, oversample=0.0),
                                global_batch_size=8 * n, seed=0)
    generation = types.SimpleNamespace(cfg=cfg, controller=controller, generate=generate,
                                       sampling=lambda n, seed: types.SimpleNamespace(n=n, seed=seed))
    source = ColocatedSource(generation, sampler, prompts)
    trained = Counter()
    for step in range(300):
        rollouts, _ = source.rollouts(step, None)
        assert len(rollouts) == 8 * n
        trained.update(r.domain for r in rollouts)
    share_a = trained["a"] / sum(trained.values())
    assert abs(share_a - 0.5) < 0.03, share_a  # 0.60 when the surplus came from b alone
