"""Trainer behaviour on one rank: the pluggable loss sees correctly aligned inputs, gradient
clipping and the LR schedule follow their formulas, and packing does not change log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _samples():
    from megatron_rl.trainer.packing import Sample

    gen = torch.Generator().manual_seed(1)
    out = []
    for n in (8, 13, 5, 11):
        mask = torch.ones(n - 1)
        mask[:2] = 0
        out.append(Sample(torch.randint(0, 128, (n,), generator=gen), mask,
                          {"advantage": torch.randn(n - 1, generator=gen)}))
    return out


def _no_loss_sample():
    from megatron_rl.trainer.packing import Sample

    gen = torch.Generator().manual_seed(2)
    return Sample(torch.randint(0, 128, (12,), generator=gen), torch.zeros(11),
                  {"advantage": torch.randn(11, generator=gen)})


def _worker(rank: int, world: int, out_path: str) -> None:
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=60)
    groups = state.initialize(1, 1)
    model_cfg = ModelConfig(num_layers=2)
    full = random_state_dict(model_cfg, seed=5)
    results: dict = {}

    # 1. packing: one row per sample vs all samples in one row give the same log-probs
    small = Trainer(model_cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=13))
    small.load_full_state_dict(full)
    big = Trainer(model_cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=64))
    big.load_full_state_dict(full)
    results["lp_small"], _ = small.forward_logprobs(_samples())
    results["lp_big"], _ = big.forward_logprobs(_samples())

    # 2. the loss function's inputs: policy-gradient style loss with per-token extras
    seen = []

    def pg_loss(inp):
        seen.append(dict(num_tokens=inp.num_tokens, num_samples=inp.num_samples,
                         sample_ids=inp.sample_ids.clone(), sample_num_tokens=inp.sample_num_tokens.clone(),
                         advantage=inp.extras["advantage"].clone(), mask=inp.loss_mask.clone(),
                         logprobs=inp.logprobs.detach().clone()))
        loss = -(inp.logprobs * inp.extras["advantage"] * inp.loss_mask).sum() / inp.num_tokens
        return loss, {"pg_loss": loss.detach()}

    metrics = big.train_step(_samples(), pg_loss)
    results["seen"], results["pg_metrics"] = seen, metrics

    # 3. gradient clipping with SGD: the update is exactly lr * clipped gradient
    sgd = Trainer(model_cfg, OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.01), groups,
                  TrainerOptions(micro_batch_tokens=64))
    sgd.load_full_state_dict(full)
    before = sgd.full_state_dict()
    results["sgd_metrics"] = sgd.train_step(_samples())
    after = sgd.full_state_dict()
    results["sgd_update_norm"] = math.sqrt(sum(float(((after[k] - before[k]) ** 2).sum()) for k in before))

    # 4. reference-policy snapshots: swap in, swap back
    reference = big.snapshot_weights()
    before = big.full_state_dict()
    big.train_step(_samples())
    trained = big.full_state_dict()
    current = big.swap_weights(reference)
    swapped_in = big.full_state_dict()
    big.swap_weights(current)
    swapped_back = big.full_state_dict()
    results["swap"] = (before, trained, swapped_in, swapped_back)

    # 4b. the same for a mixture of experts whose routers' selection bias (a buffer) the step moves
    moe_cfg = ModelConfig(family="deepseek_v3", num_layers=2, num_query_groups=4, num_experts=4, moe_ffn_hidden_size=32,
                          moe_shared_expert_intermediate_size=32, moe_dense_layers=[0], kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, moe_router_bias_update_rate=1e-3)
    moe = Trainer(moe_cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=64))
    moe.initialize_weights()
    reference = moe.snapshot_weights()
    before = moe.full_state_dict()
    moe.train_step(_samples())
    trained = moe.full_state_dict()
    current = moe.swap_weights(reference)
    swapped_in = moe.full_state_dict()
    moe.swap_weights(current)
    results["moe_swap"] = (before, trained, swapped_in, moe.full_state_dict())

    # 6. the loss sees the loss-mask targets only; the kept log-probs are NaN at the others (on both output paths)
    for fused in (True, False):
        cfg = ModelConfig(num_layers=2, fused_logprobs=fused)
        keeper = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=64))
        keeper.load_full_state_dict(full)
        lp_full, _ = keeper.forward_logprobs(_samples())
        # forward_logprobs likewise with loss_targets_only, a sample without loss tokens among them
        lp_loss, _ = keeper.forward_logprobs(_samples() + [_no_loss_sample()], loss_targets_only=True)
        results[f"forward_{fused}"] = (lp_full, lp_loss)
        keeper.train_step(_samples(), keep_logprobs=True)
        results[f"kept_{fused}"] = (lp_full, keeper.last_logprobs)

        # 7. a sample without loss tokens (a filtered one), alone in its micro-batch, changes nothing: SGD from the
        # same weights lands on the same weights with or without it
        after = []
        for extra in ([], [_no_loss_sample()]):
            sgd = Trainer(cfg, OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0), groups,
                          TrainerOptions(micro_batch_tokens=13))
            sgd.load_full_state_dict(full)
            metrics = sgd.train_step(_samples() + extra, keep_logprobs=True)
            after.append((sgd.full_state_dict(), metrics, sgd.last_logprobs))
        results[f"no_loss_{fused}"] = after

    # 5. LR schedule: warmup then cosine decay
    sched = Trainer(model_cfg, OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_style="cosine",
                                               lr_decay_steps=6), groups, TrainerOptions(micro_batch_tokens=64))
    sched.load_full_state_dict(full)
    results["lrs"] = [sched.train_step(_samples())["lr"] for _ in range(7)]
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer") / "r.pt"
    run_spawned(_worker, 1, str(out))
    return torch.load(out, weights_only=False)


def test_packing_does_not_change_logprobs(results):
    for a, b in zip(results["lp_small"], results["lp_big"], strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_loss_inputs_are_aligned_with_the_samples(results):
    """The loss sees each sample's loss-mask targets (the first two of each are masked out), in order."""
    samples = _samples()
    seen = results["seen"]
    total_tokens = int(sum(s.loss_mask.sum() for s in samples))
    for mb in seen:
        assert mb["num_tokens"] == total_tokens and mb["num_samples"] == len(samples)
        for i in mb["sample_ids"].unique().tolist():
            sel = mb["sample_ids"] == i
            counted = samples[i].loss_mask.bool()
            assert torch.equal(mb["advantage"][sel], samples[i].extras["advantage"][counted])
            assert torch.equal(mb["mask"][sel], samples[i].loss_mask[counted])
            assert torch.allclose(mb["logprobs"][sel], results["lp_big"][i][counted], atol=1e-5)
            assert torch.all(mb["sample_num_tokens"][sel] == samples[i].loss_mask.sum())
    covered = sorted(i for mb in seen for i in mb["sample_ids"].unique().tolist())
    assert covered == list(range(len(samples)))


def test_reported_loss_is_the_global_policy_gradient_loss(results):
    samples = _samples()
    expected = -sum(float((lp * s.extras["advantage"] * s.loss_mask).sum())
                    for lp, s in zip(results["lp_big"], samples)) / float(sum(s.loss_mask.sum() for s in samples))
    assert results["pg_metrics"]["pg_loss"] == pytest.approx(expected, rel=1e-5)


def test_gradient_clipping_bounds_the_sgd_update(results):
    grad_norm = results["sgd_metrics"]["grad_norm"]
    assert grad_norm > 0.01, "the test needs a gradient above the clip threshold"
    # SGD: update = lr * g * clip / (|g| + 1e-6), so its norm is lr * clip (up to the 1e-6)
    assert results["sgd_update_norm"] == pytest.approx(0.5 * 0.01 * grad_norm / (grad_norm + 1e-6), rel=1e-4)


def test_weight_snapshot_swaps_in_and_back(results):
    before, trained, swapped_in, swapped_back = results["swap"]
    assert any(not torch.equal(before[k], trained[k]) for k in before), "the step must change weights"
    for key in before:
        assert torch.equal(swapped_in[key], before[key]), key
        assert torch.equal(swapped_back[key], trained[key]), key


def test_weight_snapshot_includes_the_routers_selection_bias(results):
    """With the auxiliary-loss-free update on, the step moves the routers' selection bias (a buffer); the
    reference policy swapped in routes with the bias it started from, and swapping back restores the moved one."""
    before, trained, swapped_in, swapped_back = results["moe_swap"]
    biases = [k for k in before if k.endswith(".router.expert_bias")]
    assert biases and all(not torch.equal(before[k], trained[k]) for k in biases)
    for key in before:
        assert torch.equal(swapped_in[key], before[key]), key
        assert torch.equal(swapped_back[key], trained[key]), key


def test_lr_schedule_warmup_then_cosine(results):
    # Megatron's scheduler: lr after k scheduler steps; warmup lr = max_lr * k / warmup,
    # then cosine from max to min over (decay_steps - warmup) steps, min_lr afterwards.
    def expected(k):
        if k <= 2:
            return 1e-3 * k / 2
        ratio = min(1.0, (k - 2) / (6 - 2))
        return 1e-4 + 0.5 * (1e-3 - 1e-4) * (math.cos(math.pi * ratio) + 1)

    # step k (0-based) trains with lr(k + 1): no zero-lr first step
    got = results["lrs"]
    want = [expected(k + 1) for k in range(7)]
    assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
def test_kept_logprobs_are_the_forwards_at_the_loss_targets_and_nan_elsewhere(results, fused):
    full, kept = results[f"kept_{fused}"]
    for s, lp, k in zip(_samples(), full, kept, strict=True):
        counted = s.loss_mask.bool()
        assert torch.allclose(k[counted], lp[counted], atol=1e-5)
        assert torch.isnan(k[~counted]).all(), "a target the step did not compute holds a number"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
def test_a_sample_without_loss_tokens_alone_in_its_micro_batch_changes_nothing(results, fused):
    (without, m0, kept0), (with_it, m1, kept1) = results[f"no_loss_{fused}"]
    assert m0["grad_norm"] > 0 and m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
    assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-5) and m1["num_tokens"] == m0["num_tokens"]
    for name, value in without.items():
        assert torch.allclose(with_it[name], value, atol=1e-6), name
    assert len(kept1) == len(kept0) + 1 and torch.isnan(kept1[-1]).all() and kept1[-1].shape == (11,)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
def test_forward_logprobs_of_the_loss_targets_only(results, fused):
    full, restricted = results[f"forward_{fused}"]
    assert len(restricted) == len(full) + 1 and torch.isnan(restricted[-1]).all()
    for s, lp, r in zip(_samples(), full, restricted):
        counted = s.loss_mask.bool()
        assert torch.allclose(r[counted], lp[counted], atol=1e-5) and torch.isnan(r[~counted]).all()
