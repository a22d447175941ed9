"""The critic (`Trainer(head="value")`, algorithm.critic): it starts from the policy's weights with a
zero value head, its clipped value loss trains it to predict returns, and its values and updates
agree across parallel layouts (TP=2 with sequence parallelism, whose value head gathers the
sequence and must not sum its gradient over TP ranks; PP=2, where the head lives on the last
stage only; DP=2) with the single-process run.

Tolerances as in test_parity.py (fp32, reductions reordered across ranks): values of magnitude ~1
after three Adam steps agree to 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUTS = {
    "tp2_sp": dict(tp=2, pp=1, sequence_parallel=True),
    "pp2": dict(tp=1, pp=2, sequence_parallel=False),
    "dp2": dict(tp=1, pp=1, sequence_parallel=False),
}
PARITY_STEPS = 3
LEARN_STEPS = 40


def _tokens():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (n,), generator=gen) for n in (9, 17, 30, 12, 25, 6, 21, 14)]


def _target(tokens: torch.Tensor) -> float:
    """Each sample's return on every response token: a function of its first token, which every
    position sees (causal attention), so a critic can learn it exactly."""
    return 1.0 if int(tokens[0]) % 2 == 0 else -1.0


def _samples(values=None):
    from megatron_rl.trainer.packing import Sample

    out = []
    for i, tokens in enumerate(_tokens()):
        n = tokens.numel()
        mask = torch.ones(n - 1)
        mask[: n // 3] = 0.0  # the "prompt": no loss
        extras = {"returns": torch.full((n - 1,), _target(tokens)) * mask,
                  "old_values": torch.zeros(n - 1) if values is None else values[i].clone()}
        out.append(Sample(tokens, mask, extras))
    return out


def _worker(rank: int, world: int, layouts: dict, learn: bool, out_path: str) -> None:
    from megatron_rl.algorithms.objective import make_value_loss_fn
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    model_cfg = ModelConfig(family="qwen2", num_layers=2, tie_word_embeddings=True)
    full = random_state_dict(model_cfg, seed=3)
    loss_fn = make_value_loss_fn(0.5)
    results = {}
    for name, layout in layouts.items():
        groups = state.initialize(layout["tp"], layout["pp"], sequence_parallel=layout["sequence_parallel"])
        options = TrainerOptions(micro_batch_tokens=48)
        policy = Trainer(model_cfg, OptimizerConfig(), groups, options)
        policy.load_full_state_dict(full)
        policy_before = policy.full_state_dict()
        critic = Trainer(model_cfg, OptimizerConfig(lr=1e-2), groups, options, head="value")
        critic.copy_body_from(policy)
        first, _ = critic.forward_logprobs(_samples())
        values, steps = first, []
        for _ in range(LEARN_STEPS if learn else PARITY_STEPS):
            steps.append(critic.train_step(_samples(values), loss_fn))
            values, _ = critic.forward_logprobs(_samples())
            if len(steps) == PARITY_STEPS:
                after_parity = values
        policy_after = policy.full_state_dict()
        unchanged = all(torch.equal(policy_before[k], policy_after[k]) for k in policy_before)
        results[name] = dict(first=first, steps=steps, values=after_parity, learned=values, policy_unchanged=unchanged)
        state.destroy()
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("critic")
    run_spawned(_worker, 1, {"ref": dict(tp=1, pp=1, sequence_parallel=False)}, True, str(out / "ref.pt"))
    run_spawned(_worker, 2, LAYOUTS, False, str(out / "layouts.pt"))
    return torch.load(out / "ref.pt")["ref"], torch.load(out / "layouts.pt")


def _explained_variance(values, samples) -> float:
    mask = torch.cat([s.loss_mask for s in samples]).bool()
    returns = torch.cat([s.extras["returns"] for s in samples])[mask]
    predicted = torch.cat(values)[mask]
    return 1.0 - float((returns - predicted).var(unbiased=False) / returns.var(unbiased=False))


def test_a_new_critic_predicts_zero_everywhere(results):
    ref, runs = results
    for run in (ref, *runs.values()):
        assert all(v.abs().max() == 0 for v in run["first"])
        assert [v.numel() for v in run["first"]] == [t.numel() - 1 for t in _tokens()]


def test_the_first_value_loss_is_half_the_mean_squared_return(results):
    ref, _ = results
    samples = _samples()
    tokens = sum(float(s.loss_mask.sum()) for s in samples)
    expected = 0.5 * sum(float((s.extras["returns"] ** 2 * s.loss_mask).sum()) for s in samples) / tokens
    assert ref["steps"][0]["value_loss"] == pytest.approx(expected, rel=1e-6)
    assert ref["steps"][0]["values"] == 0.0


def test_the_critic_learns_the_returns(results):
    ref, _ = results
    losses = [m["value_loss"] for m in ref["steps"]]
    assert losses[-1] < 0.1 * losses[0], losses
    assert _explained_variance(ref["learned"], _samples()) > 0.9


def test_training_the_critic_leaves_the_policy_alone(results):
    ref, runs = results
    assert ref["policy_unchanged"] and all(run["policy_unchanged"] for run in runs.values())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_values_and_updates_match_the_single_process(results, layout):
    ref, runs = results
    got = runs[layout]
    assert any(v.abs().max() > 0.05 for v in ref["values"]), "the critic did not move: nothing compared"
    for mine, want in zip(got["values"], ref["values"]):
        assert torch.allclose(mine, want, atol=1e-4), (mine - want).abs().max()
    for mine, want in zip(got["steps"], ref["steps"][:PARITY_STEPS]):
        assert mine["value_loss"] == pytest.approx(want["value_loss"], rel=1e-5, abs=1e-7)
        assert mine["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
