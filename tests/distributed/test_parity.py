"""Parallel layouts agree with the single-process run of the same model and batch.

One spawned single process gives the reference; one spawned pair of processes runs each
two-rank layout in turn (TP=2, TP=2 + sequence parallel, PP=2, CP=2, DP=2, DP=2 with the
distributed optimizer); `test_context_parallel.py` runs the four-rank mixes with CP. Compared per layout: the per-token log-probs of every sample, the
loss, the gradient norm, and every weight after one Adam step.

Tolerances (fp32): reductions are re-ordered across ranks, so values agree to rounding,
not bit-exactly. Log-probs of ~5 nats with fp32 epsilon 1.2e-7 leave ~1e-6 of rounding;
we allow 2e-5. Weights after one Adam step (lr 1e-3) may move by at most lr, so 1e-6
absolute would catch any update computed from a different gradient.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUTS = {
    "tp2": dict(tp=2, pp=1, sequence_parallel=False, distopt=False),
    "tp2_sp": dict(tp=2, pp=1, sequence_parallel=True, distopt=False),
    "pp2": dict(tp=1, pp=2, sequence_parallel=False, distopt=False),
    "cp2": dict(tp=1, pp=1, cp=2, sequence_parallel=False, distopt=False),
    "dp2": dict(tp=1, pp=1, sequence_parallel=False, distopt=False),
    "dp2_distopt": dict(tp=1, pp=1, sequence_parallel=False, distopt=True),
}
REFERENCE = dict(tp=1, pp=1, sequence_parallel=False, distopt=False)


def _samples():
    from megatron_rl.trainer.packing import Sample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for n in (9, 17, 30, 12, 25, 6, 21, 14):
        tokens = torch.randint(0, 128, (n,), generator=gen)
        mask = torch.ones(n - 1)
        mask[: n // 3] = 0.0  # a "prompt" part that does not count in the loss
        samples.append(Sample(tokens, mask))
    return samples


def _worker(rank: int, world: int, layouts: dict, out_path: str) -> None:
    import torch

    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    env = mdist.dist_env_from()
    mdist.init_distributed(env, torch.device("cpu"), timeout_s=120)
    model_cfg = ModelConfig(family="qwen2", num_layers=4, tie_word_embeddings=True)
    full = random_state_dict(model_cfg, seed=3)
    results = {}
    for name, layout in layouts.items():
        groups = state.initialize(layout["tp"], layout["pp"], layout.get("cp", 1),
                                  sequence_parallel=layout["sequence_parallel"])
        trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-3, clip_grad=1.0), groups,
                          TrainerOptions(micro_batch_tokens=48, use_distributed_optimizer=layout["distopt"]))
        trainer.load_full_state_dict(full)
        samples = _samples()
        logprobs, entropy = trainer.forward_logprobs(samples, with_entropy=True)
        metrics = trainer.train_step(samples)
        weights = trainer.full_state_dict()
        results[name] = dict(logprobs=logprobs, entropy=entropy, metrics=metrics, weights=weights)
        state.destroy()
    if rank == 0:
        torch.save(results, out_path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    run_spawned(_worker, 1, {"ref": REFERENCE}, str(out / "ref.pt"))
    run_spawned(_worker, 2, LAYOUTS, str(out / "layouts.pt"))
    ref = torch.load(out / "ref.pt")["ref"]
    return ref, torch.load(out / "layouts.pt")


def test_reference_logprobs_match_plain_log_softmax(results):
    """The single-process reference itself: compared with transformers' model on the same weights."""
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import build_hf_model

    ref, _ = results
    hf = build_hf_model(ModelConfig(family="qwen2", num_layers=4, tie_word_embeddings=True), seed=3)
    for sample, lp, ent in zip(_samples(), ref["logprobs"], ref["entropy"]):
        with torch.no_grad():
            logits = hf(sample.tokens[None]).logits[0, :-1].double()
        logp = torch.log_softmax(logits, -1)
        expected = logp.gather(-1, sample.tokens[1:, None])[:, 0]
        assert torch.allclose(lp.double(), expected, atol=2e-5), (lp - expected).abs().max()
        expected_ent = -(logp.exp() * logp).sum(-1)
        assert torch.allclose(ent.double(), expected_ent, atol=2e-5)


def test_reference_step_moves_every_trained_weight(results):
    """Guards the comparisons below against a step that changed nothing."""
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import random_state_dict

    ref, _ = results
    initial = random_state_dict(ModelConfig(family="qwen2", num_layers=4, tie_word_embeddings=True), seed=3)
    for key, value in ref["weights"].items():
        assert (value - initial[key]).abs().max() > 1e-5, f"{key} did not change"


def test_reference_loss_is_masked_token_mean(results):
    ref, _ = results
    samples = _samples()
    total = sum((-(lp * s.loss_mask)).sum() for lp, s in zip(ref["logprobs"], samples))
    expected = total / sum(s.loss_mask.sum() for s in samples)
    assert abs(ref["metrics"]["loss"] - float(expected)) < 1e-5


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logprobs_match_single_process(results, layout):
    ref, runs = results
    for got, want in zip(runs[layout]["logprobs"], ref["logprobs"]):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    for got, want in zip(runs[layout]["entropy"], ref["entropy"]):
        assert torch.allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_and_grad_norm_match_single_process(results, layout):
    ref, runs = results
    got, want = runs[layout]["metrics"], ref["metrics"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["num_tokens"] == want["num_tokens"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_updated_weights_match_single_process(results, layout):
    ref, runs = results
    got, want = runs[layout]["weights"], ref["weights"]
    assert sorted(got) == sorted(want)
    for key in want:
        diff = (got[key] - want[key]).abs().max().item()
        assert diff <= 1e-6, f"{key}: max abs diff {diff:.3e}"
