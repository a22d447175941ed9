"""The loop's reward shaping and sample selection (rl.advantages.select_samples, rewards.shaping.shaped_rewards)
on hand-made rollouts, against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.rewards.shaping import shaped_rewards
from megatron_rl.rl.advantages import select_samples
from megatron_rl.rollout.colocated import combine_rounds
from megatron_rl.rollout.collect import Rollout


def _rollouts(rewards, lengths, reasons, groups):
    return [Rollout(g, [1, 2], [5] * n, [0.0] * n, why, 1, r) for r, n, why, g in zip(rewards, lengths, reasons, groups)]


def _cfg(*overrides):
    return load_config(["rollout.max_new_tokens=8", *overrides], world_size=1)


def test_no_filter_keeps_everything_and_rewards_are_unchanged():
    rollouts = _rollouts([1, 0, 1, 1], [3, 8, 2, 8], ["stop", "length", "stop", "length"], [0, 0, 1, 1])
    cfg = _cfg()
    rewards = shaped_rewards(cfg, rollouts)
    assert rewards.tolist() == [1, 0, 1, 1]
    keep, stats = select_samples(cfg, rollouts, rewards)
    assert keep.tolist() == [True] * 4 and stats == {"filter/kept_samples": 4.0}


def test_zero_variance_and_overlong_filters():
    rollouts = _rollouts([1, 0, 1, 1, 0, 1], [3, 8, 2, 8, 8, 1], ["stop", "length", "stop", "stop", "length", "stop"],
                         [0, 0, 1, 1, 2, 2])
    cfg = _cfg("algorithm.filter_zero_variance=true", "algorithm.overlong=filter")
    keep, stats = select_samples(cfg, rollouts, shaped_rewards(cfg, rollouts))
    # group 1 has rewards (1, 1): dropped; samples 1 and 4 stopped at the length limit: dropped.
    assert keep.tolist() == [True, False, False, False, False, True]
    assert stats == {"filter/zero_variance_dropped": 2.0, "filter/overlong_dropped": 2.0, "filter/kept_samples": 2.0}


def test_a_step_with_no_rollouts_selects_nothing():
    """Dynamic sampling that kept no group leaves the step no rollouts: every filter still runs (the overlong
    filter's masks were float tensors when empty, and `~` refused them)."""
    cfg = _cfg("algorithm.filter_zero_variance=true", "algorithm.overlong=filter")
    keep, stats = select_samples(cfg, [], shaped_rewards(cfg, []))
    assert keep.dtype == torch.bool and keep.numel() == 0
    assert stats == {"filter/zero_variance_dropped": 0.0, "filter/overlong_dropped": 0.0, "filter/kept_samples": 0.0}


def test_overlong_penalty_ramps_over_the_window():
    rollouts = _rollouts([1, 1, 1, 0], [3, 5, 8, 6], ["stop", "stop", "length", "stop"], [0, 0, 1, 1])
    cfg = _cfg("algorithm.overlong=penalty", "algorithm.overlong_penalty_window=4", "algorithm.overlong_penalty=0.5")
    # window starts at 8 - 4 = 4: length 3 -> 0; 5 -> 0.5 * (4 - 5) / 4; 8 -> 0.5 * (4 - 8) / 4; 6 -> 0.5 * (4 - 6) / 4
    expected = torch.tensor([1.0, 1 - 0.125, 1 - 0.5, 0 - 0.25])
    assert torch.allclose(shaped_rewards(cfg, rollouts), expected)


def test_penalty_window_longer_than_the_response_limit_is_refused():
    from megatron_rl.config import ConfigError
    from megatron_rl.config.checks.run import check_run

    with pytest.raises(ConfigError, match="overlong_penalty_window=9 must be <= rollout.max_new_tokens=8"):
        check_run(_cfg("mode=rl", "algorithm.overlong=penalty", "algorithm.overlong_penalty_window=9"))


def test_dynamic_sampling_rounds_combine_into_one_steps_metrics():
    """Two rounds: 4 s at 50 % engine busy and 2 s at 25 % are 2.5 of 6 s busy; times and counts add up;
    episode means are weighted by the rounds' episodes (5 + 1 here, of a joint run's domain 2 + 6)."""
    rounds = [{"time/episodes": 4.0, "sched/wall_s": 4.0, "sched/engine_busy": 0.5, "agent/turns_mean": 3.0,
               "agent/episodes": 5.0, "agent/submitted": 5.0, "agent/env/tests_passed": 0.2,
               "agent/env_count/tests_passed": 5.0, "domain/cd/sched/wall_s": 1.0,
               "domain/cd/sched/engine_busy": 1.0, "domain/cd/agent/turns_mean": 1.0, "domain/cd/agent/episodes": 2.0},
              {"time/episodes": 2.0, "sched/wall_s": 2.0, "sched/engine_busy": 0.25, "agent/turns_mean": 5.0,
               "agent/episodes": 1.0, "agent/submitted": 1.0, "agent/env/tests_passed": 0.6,
               "agent/env_count/tests_passed": 1.0, "domain/cd/sched/wall_s": 3.0,
               "domain/cd/sched/engine_busy": 0.0, "domain/cd/agent/turns_mean": 3.0, "domain/cd/agent/episodes": 6.0}]
    got = combine_rounds(rounds)
    assert got["sched/engine_busy"] == pytest.approx(2.5 / 6)
    assert got["domain/cd/sched/engine_busy"] == pytest.approx(1.0 / 4)
    assert (got["time/episodes"], got["sched/wall_s"], got["agent/submitted"]) == (6.0, 6.0, 6.0)
    assert got["agent/turns_mean"] == pytest.approx((3.0 * 5 + 5.0 * 1) / 6)
    assert got["agent/env/tests_passed"] == pytest.approx((0.2 * 5 + 0.6 * 1) / 6)
    assert got["domain/cd/agent/turns_mean"] == pytest.approx((1.0 * 2 + 3.0 * 6) / 8)
    assert combine_rounds(rounds[:1]) == rounds[0]


def test_rounds_of_episodes_combine_to_the_means_over_all_their_episodes():
    """Per-round `episode_metrics`, combined, equal `episode_metrics` of every round's episodes at once: lost
    episodes (an agent program's agent_failed) count in the turns' mean, and an environment number is a mean over
    the episodes that report it."""
    from megatron_rl.rollout.multiturn import Episode, episode_metrics

    def episode(turns, status, info):
        return Episode(0, [1], [], [], "stop", 0, num_turns=turns, status=status, info=info)

    first = [episode(1, "agent_failed", {}) for _ in range(4)] + \
        [episode(1, "submitted", {"tests_passed": 1.0}) for _ in range(4)]
    second = [episode(3, "submitted", {"tests_passed": 0.0}) for _ in range(2)] + \
        [episode(3, "max_turns", {}) for _ in range(6)]
    got = combine_rounds([episode_metrics(first), episode_metrics(second)])
    whole = episode_metrics(first + second)
    assert whole["agent/turns_mean"] == 2.0 and whole["agent/env/tests_passed"] == pytest.approx(4 / 6)
    assert got == pytest.approx(whole)


def test_engines_of_one_step_combine_into_its_scheduler_metrics():
    """Two engines at once (4 s at 50 % busy, 2 s at 25 %): the step waited 4 s, the engines were busy
    2.5 of their 6 s; counts add up; a rank without an engine brings nothing."""
    from megatron_rl.rollout.scheduler import combine_engines

    a = {"sched/wall_s": 4.0, "sched/engine_busy": 0.5, "sched/aborted": 2.0, "sched/backpressure_wait_s": 1.0}
    b = {"sched/wall_s": 2.0, "sched/engine_busy": 0.25, "sched/aborted": 1.0, "sched/backpressure_wait_s": 0.5}
    got = combine_engines([a, {}, b])
    assert got == pytest.approx({"sched/wall_s": 4.0, "sched/engine_busy": 2.5 / 6, "sched/aborted": 3.0,
                                 "sched/backpressure_wait_s": 1.5})
    assert combine_engines([a]) == a and combine_engines([{}, {}]) == {}


def _episode(group, reward, status, turns=((3, 2), (3, 0)), length=None):
    """An agent episode of model turns (model tokens, observation tokens after them)."""
    from megatron_rl.rollout.multiturn import Episode

    mask = [m for model, obs in turns for m in [1] * model + [0] * obs]
    return Episode(group, [1, 2], [5] * len(mask), [0.0] * len(mask), "stop", 1, reward, model_mask=mask,
                   status=status)


def test_lost_episodes_take_no_part_in_the_group_baseline():
    """Group 0: three correct answers and one episode lost to a sandbox failure: no variance among the
    scored ones, so no advantage (a lost 0 in the baseline would give each survivor +0.5) and the
    zero-variance filter drops the group. Group 1: 1, 0 and a deadline: GRPO over (1, 0) only."""
    from megatron_rl.rl.advantages import step_advantages

    rollouts = [_episode(0, 1.0, "submitted"), _episode(0, 1.0, "submitted"), _episode(0, 1.0, "max_turns"),
                _episode(0, 0.0, "dropped"), _episode(1, 1.0, "submitted"), _episode(1, 0.0, "submitted"),
                _episode(1, 0.0, "deadline")]
    cfg = _cfg("algorithm.filter_zero_variance=true")
    rewards = shaped_rewards(cfg, rollouts)
    advantages, returns = step_advantages(cfg, rollouts, rewards)
    assert returns is None  # no critic
    assert advantages[3] is None and advantages[6] is None
    for i in (0, 1, 2):
        assert advantages[i].tolist() == [0.0] * 8
    # (1 - 0.5) / (std of (1, 0) = sqrt(0.5) + 1e-6), on every response token
    expected = 0.5 / (0.5 ** 0.5 + 1e-6)
    assert torch.allclose(advantages[4], torch.full((8,), expected)) and torch.allclose(advantages[5], -advantages[4])
    keep, stats = select_samples(cfg, rollouts, rewards)
    assert keep.tolist() == [False, False, False, False, True, True, False]
    assert stats == {"filter/dropped_episodes": 2.0, "filter/zero_variance_dropped": 3.0, "filter/kept_samples": 2.0}


def test_dynamic_sampling_judges_a_group_by_its_scored_samples():
    from megatron_rl.algorithms.filters import has_reward_variance
    from megatron_rl.rewards.shaping import group_verdicts

    assert not has_reward_variance(group_verdicts([_episode(0, 1.0, "submitted"), _episode(0, 0.0, "dropped")]))
    assert not has_reward_variance(group_verdicts([_episode(0, 0.0, "deadline")] * 2))
    assert has_reward_variance(group_verdicts([_episode(0, 1.0, "submitted"), _episode(0, 0.0, "max_turns")]))


def test_dynamic_sampling_drops_a_group_whose_answers_differ_only_in_length():
    """DAPO keeps a group when 0 < correct < n (its eq. 11): four right answers of lengths 10, 18, 12 and 19
    under the overlong penalty (limit 20, window 4) have shaped rewards 1, 0.5, 1, 0.25, yet the group is
    dropped; one wrong answer among them keeps it."""
    from megatron_rl.algorithms.filters import has_reward_variance
    from megatron_rl.rewards.shaping import group_verdicts, shaped_rewards

    cfg = _cfg("algorithm.overlong=penalty", "algorithm.overlong_penalty_window=4", "rollout.max_new_tokens=20")
    group = [Rollout(0, [1], [5] * n, [0.0] * n, "stop", 0, reward=1.0) for n in (10, 18, 12, 19)]
    assert shaped_rewards(cfg, group).tolist() == [1.0, 0.5, 1.0, 0.25]
    assert not has_reward_variance(group_verdicts(group))
    group[0].reward = 0.0
    assert has_reward_variance(group_verdicts(group))


def test_overlong_shaping_leaves_agent_episodes_alone():
    """An episode of two 3-token turns plus tool output is 8 tokens long, which is rollout.max_new_tokens (a
    per-turn limit): neither the penalty nor the filter applies to it; a single-turn response still gets both."""
    single = _rollouts([1.0], [8], ["length"], [1])
    rollouts = [_episode(0, 1.0, "submitted"), _episode(0, 0.0, "submitted"), *single]
    penalty = _cfg("algorithm.overlong=penalty", "algorithm.overlong_penalty_window=4")
    assert shaped_rewards(penalty, rollouts).tolist() == [1.0, 0.0, 0.0]
    filtered = _cfg("algorithm.overlong=filter")
    keep, stats = select_samples(filtered, rollouts, shaped_rewards(filtered, rollouts))
    assert keep.tolist() == [True, True, False] and stats["filter/overlong_dropped"] == 1.0


def test_gae_without_a_critic():
    """advantage_estimator=gae, values 0: each reward sits on its sample's last model token; the recursion
    skips tool output; the result is whitened over all model tokens of the batch. By hand for gamma = 0.5,
    lambda = 1: a token k model tokens before the end gets r * 0.5**k."""
    from megatron_rl.rl.advantages import step_advantages

    cfg = _cfg("algorithm.advantage_estimator=gae", "algorithm.gae_gamma=0.5", "rollout.n_samples_per_prompt=1")
    single = _rollouts([2.0], [3], ["stop"], [1])[0]
    episode = _episode(0, 1.0, "submitted", turns=((2, 2), (1, 0)))
    lost = _episode(2, 1.0, "dropped")
    rollouts = [episode, single, lost]
    advantages, _ = step_advantages(cfg, rollouts, shaped_rewards(cfg, rollouts))
    raw_episode = [0.25, 0.5, 0.0, 0.0, 1.0]  # model tokens 0, 1, (tool, tool), 2
    raw_single = [0.5, 1.0, 2.0]
    values = torch.tensor([0.25, 0.5, 1.0, 0.5, 1.0, 2.0])
    mean, std = values.mean(), values.std(unbiased=False)

    def whiten(xs, m):
        return [(x - mean) / torch.sqrt(std ** 2 + 1e-8) * k for x, k in zip(xs, m)]
    assert torch.allclose(advantages[0], torch.tensor(whiten(raw_episode, [1, 1, 0, 0, 1])))
    assert torch.allclose(advantages[1], torch.tensor(whiten(raw_single, [1, 1, 1])))
    assert advantages[2] is None


def test_reinforce_pp_in_the_step_whitens_over_model_tokens():
    """verl and OpenRLHF whiten REINFORCE++-baseline's centred rewards over the batch's response tokens, so
    each sample weighs its number of model tokens (an episode's tool output does not count). Groups:
    0: rewards 1, 0 with 2 and 6 tokens; 1: an episode of 3 + 1 model tokens (2 tool tokens between) with
    reward 1, and 0 with 4 tokens; 2: 0.5, 0.5 with 3 and 5 tokens (no variance).
    Centred a = 1/2, -1/2, 1/2, -1/2, 0, 0; weights 2, 6, 4, 4, 3, 5 (24 tokens).
    Token mean m = (1 - 3 + 2 - 2) / 24 = -1/12; a - m = 7/12, -5/12, 7/12, -5/12, 1/12, 1/12;
    population variance (2*49 + 6*25 + 4*49 + 4*25 + 3 + 5) / 144 / 24 = 23/144, std = sqrt(23)/12.
    A = 7/sqrt(23), -5/sqrt(23) on the varied groups; group 2 gets 0 (the peers would give it 1/sqrt(23))."""
    from megatron_rl.rl.advantages import step_advantages

    cfg = _cfg("algorithm.advantage_estimator=reinforce_pp")
    episode = _episode(1, 1.0, "submitted", turns=((3, 2), (1, 0)))
    rollouts = [*_rollouts([1, 0], [2, 6], ["stop"] * 2, [0, 0]), episode, *_rollouts([0], [4], ["stop"], [1]),
                *_rollouts([0.5, 0.5], [3, 5], ["stop"] * 2, [2, 2])]
    advantages, returns = step_advantages(cfg, rollouts, shaped_rewards(cfg, rollouts))
    high, low = 7 / 23 ** 0.5, -5 / 23 ** 0.5
    expected = [[high] * 2, [low] * 6, [high] * 6, [low] * 4, [0.0] * 3, [0.0] * 5]  # broadcast over output_ids
    assert returns is None
    for got, want in zip(advantages, expected):
        assert torch.allclose(got, torch.tensor(want), rtol=1e-5, atol=0), (got, want)


def test_every_advantage_estimator_runs_in_the_step():
    """Each estimator the config accepts gives finite per-token advantages through step_advantages."""
    from megatron_rl.config import AlgorithmConfig
    from megatron_rl.rl.advantages import step_advantages

    rollouts = _rollouts([1, 0, 0.5, 1], [3, 2, 4, 1], ["stop"] * 4, [0, 0, 1, 1])
    for estimator in AlgorithmConfig.ADVANTAGE_ESTIMATORS:
        cfg = _cfg(f"algorithm.advantage_estimator={estimator}")
        advantages, _ = step_advantages(cfg, rollouts, shaped_rewards(cfg, rollouts))
        assert [a.shape[0] for a in advantages] == [3, 2, 4, 1], estimator
        assert all(torch.isfinite(a).all() for a in advantages) and any(a.abs().sum() > 0 for a in advantages)
        lost = [_episode(0, 0.0, "dropped"), _episode(0, 0.0, "unscored")]  # nothing scored: no advantage, no error
        assert step_advantages(cfg, lost, shaped_rewards(cfg, lost)) == ([None, None], None), estimator


def test_evaluation_samples_with_its_own_settings():
    """task.eval_* replace rollout.* for evaluation only; unset ones fall back to training's."""
    import types

    from megatron_rl.rollout.colocated import Generation

    task = types.SimpleNamespace(stop_token_ids=(7,))
    cfg = _cfg("rollout.temperature=0.9", "rollout.top_p=0.8", "task.eval_top_k=1", "task.eval_max_new_tokens=4")
    gen = Generation(cfg, None, None, task, None, None, None)
    train, held_out = gen.sampling(4, seed=1), gen.sampling(2, seed=3, evaluation=True)
    assert (train.temperature, train.top_p, train.top_k, train.max_new_tokens, train.n) == (0.9, 0.8, -1, 8, 4)
    assert (held_out.temperature, held_out.top_p, held_out.top_k, held_out.max_new_tokens) == (0.9, 0.8, 1, 4)
    assert held_out.stop_token_ids == (7,) and held_out.seed == 3
    cfg = _cfg("task.eval_temperature=0.3", "task.eval_top_p=0.5")
    held_out = Generation(cfg, None, None, task, None, None, None).sampling(2, seed=3, evaluation=True)
    assert (held_out.temperature, held_out.top_p, held_out.max_new_tokens) == (0.3, 0.5, 8)


def test_the_environment_pool_sees_scored_samples_only():
    """A response scored 1 that is lost (a sandbox failure) in another step is no contradiction: the pool
    would have called the task flaky; its pass rate counts scored samples only."""
    import types

    from megatron_rl.data.env_pool import EnvPool
    from megatron_rl.rl.metrics import maintain

    pool = EnvPool(["t0"], task_id=str)
    solved, lost = _episode(0, 1.0, "submitted"), _episode(0, 0.0, "dropped")
    for r in (solved, lost):
        r.source_index = 0
    cfg = types.SimpleNamespace(task=types.SimpleNamespace(pool_refresh_every=100),
                                logging=types.SimpleNamespace(audit_every=0))
    maintain(types.SimpleNamespace(cfg=cfg, is_main=True), types.SimpleNamespace(env_pool=pool), 0, [solved, lost])
    assert list(pool.stats[0].rewards) == [1.0] and pool.stats[0].contradictions == 0


def test_kl_in_the_reward_reaches_both_kinds_of_estimator():
    """algorithm.kl_in_reward: a group estimator sees each reward minus the sample's summed penalty; gae
    sees the per-token penalties on top of the reward on the last token (by hand: gamma = lambda = 1,
    the reward-to-go of r_t)."""
    from megatron_rl.rl.advantages import step_advantages

    rollouts = _rollouts([1.0, 1.0, 0.0, 0.0], [2, 2, 2, 2], ["stop"] * 4, [0, 0, 1, 1])
    penalties = [torch.tensor([0.1, 0.2]), torch.tensor([0.0, 0.0]), torch.tensor([0.5, 0.0]), None]
    rollouts[3] = _episode(1, 0.0, "dropped")
    grpo = _cfg("algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true")
    advantages, _ = step_advantages(grpo, rollouts, shaped_rewards(grpo, rollouts), None, penalties)
    # group 0 sees 0.7 and 1.0: (0.7 - 0.85) / (std sqrt(0.045) + 1e-6); group 1 one scored sample: 0
    expected = -0.15 / (0.045 ** 0.5 + 1e-6)
    assert torch.allclose(advantages[0], torch.full((2,), expected)) and torch.allclose(advantages[1], -advantages[0])
    assert advantages[2].tolist() == [0.0, 0.0] and advantages[3] is None
    gae = _cfg("algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true", "algorithm.advantage_estimator=gae",
               "rollout.n_samples_per_prompt=1")
    advantages, _ = step_advantages(gae, rollouts, shaped_rewards(gae, rollouts), None, penalties)
    # token rewards (-0.1, 1 - 0.2), (0, 1), (-0.5, 0): rewards-to-go, then whitened over the six tokens
    to_go = torch.tensor([0.7, 0.8, 1.0, 1.0, -0.5, 0.0])
    whitened = (to_go - to_go.mean()) / torch.sqrt(to_go.var(unbiased=False) + 1e-8)
    assert torch.allclose(torch.cat(advantages[:3]), whitened, atol=1e-6) and advantages[3] is None


def test_gae_with_the_critics_values_and_their_returns():
    """With a critic, gae runs on its values and also returns the critic's targets R = A + V (before whitening).
    By hand, gamma = 1, lambda = 0.5, the episode's model tokens at 0, 1 and 4 (tool output at 2, 3, whose
    values are skipped), V = (0.5, 1, -1) there and reward 1 on the last:
        t=4: delta = 1 - (-1) = 2,            A = 2
        t=1: delta = 0 + (-1) - 1 = -2,       A = -2 + 0.5 * 2 = -1
        t=0: delta = 0 + 1 - 0.5 = 0.5,       A = 0.5 + 0.5 * (-1) = 0
    so R = (0.5, 0, 1) on the model tokens, 0 on tool output. The single-turn rollout (reward 2, values
    (0, 0, 0)) is the critic-free case: A = R = (2 * 0.5**2, 2 * 0.5, 2). A lost rollout gets neither."""
    from megatron_rl.rl.advantages import step_advantages

    cfg = _cfg("algorithm.advantage_estimator=gae", "algorithm.gae_lambda=0.5", "algorithm.critic=true",
               "rollout.n_samples_per_prompt=1")
    episode = _episode(0, 1.0, "submitted", turns=((2, 2), (1, 0)))
    single = _rollouts([2.0], [3], ["stop"], [1])[0]
    lost = _episode(2, 1.0, "dropped")
    values = [torch.tensor([0.5, 1.0, 9.0, 9.0, -1.0]), torch.zeros(3), None]
    advantages, returns = step_advantages(cfg, [episode, single, lost], shaped_rewards(cfg, [episode, single, lost]),
                                          values=values)
    assert torch.allclose(returns[0], torch.tensor([0.5, 0.0, 0.0, 0.0, 1.0]))
    assert torch.allclose(returns[1], torch.tensor([0.5, 1.0, 2.0]))
    assert returns[2] is None and advantages[2] is None
    raw = torch.tensor([0.0, -1.0, 2.0, 0.5, 1.0, 2.0])  # model tokens only, then whitened together
    whitened = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=False) + 1e-8)
    got = torch.cat([advantages[0][[0, 1, 4]], advantages[1]])
    assert torch.allclose(got, whitened, atol=1e-6)
    assert advantages[0][2:4].tolist() == [0.0, 0.0]
