"""The fused log-prob path equals the naive one across tensor-parallel ranks (gloo).

1. The op on two ranks, each holding an uneven shard of the vocabulary (40 + 61 rows), against
   a float64 log_softmax over the full vocabulary: log-probs, entropies, grad_hidden (the sum of
   the ranks' contributions, as Megatron's TP region sums it) and each rank's grad_weight rows.
2. The trainer with `model.fused_logprobs` true vs false, same weights and batch, at TP=1,
   TP=2 (tied embeddings), TP=2 + sequence parallel (untied output layer) and PP=2 (tied across
   stages), with temperature 0.8 and an entropy bonus in the loss so both gradients flow:
   per-token log-probs and entropies, the loss, the gradient norm and every weight after one
   Adam step.

Tolerances (fp32): only summation order differs, so log-probs and entropies agree to 2e-5 and
loss and grad norm to 1e-5 relative (as in test_parity.py). Weights after one Adam step
(lr 1e-3): Adam's first step moves a weight by lr * g / (|g| + eps), which turns rounding-level
differences of gradients with |g| near eps = 1e-8 into differences of a fraction of lr (seen: 5 of
16384 elements of one matrix at 1.0e-6; on another CPU, whose kernels sum in another order, one
element at 5.2e-6). So: every weight within 5e-5 (5% of lr; a wrong gradient moves a weight by up to
2 * lr, 40 times that), and the mean absolute difference of every tensor within 1e-8 (1e-5 of lr: a
systematic error would move many elements).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

LAYOUTS = {
    "tp2": dict(tp=2, pp=1, sequence_parallel=False, tied=True),
    "tp2_sp_untied": dict(tp=2, pp=1, sequence_parallel=True, tied=False),
    "pp2": dict(tp=1, pp=2, sequence_parallel=False, tied=True),
}
SINGLE = {"tp1": dict(tp=1, pp=1, sequence_parallel=False, tied=True)}


def _samples():
    from megatron_rl.trainer.packing import Sample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for n in (9, 17, 30, 12, 25, 6):
        tokens = torch.randint(0, 128, (n,), generator=gen)
        mask = torch.ones(n - 1)
        mask[: n // 3] = 0.0
        samples.append(Sample(tokens, mask))
    return samples


def _loss_with_entropy_bonus(inp):
    nll = -(inp.logprobs * inp.loss_mask).sum() / inp.num_tokens
    bonus = (inp.entropy * inp.loss_mask).sum() / inp.num_tokens
    loss = nll - 0.1 * bonus
    return loss, {"loss": loss.detach()}


def _op_on_two_ranks(rank: int) -> dict:
    import torch.distributed as dist

    from megatron_rl_kernels import fused_logprobs

    gen = torch.Generator().manual_seed(7)
    T, V, H = 29, 101, 16
    hidden = torch.randn(T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    targets = torch.randint(0, V, (T,), generator=gen)
    g_lp, g_ent = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    start, end = (0, 40) if rank == 0 else (40, V)
    h, w = hidden.clone().requires_grad_(), weight[start:end].clone().requires_grad_()
    lp, ent = fused_logprobs(h, w, targets, tp_group=dist.group.WORLD, vocab_start=start, temperature=0.8,
                             chunk_tokens=8, chunk_vocab=16, with_entropy=True)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    grad_hidden = h.grad.clone()
    dist.all_reduce(grad_hidden)
    return dict(lp=lp.detach(), ent=ent.detach(), grad_hidden=grad_hidden, grad_weight=w.grad, rows=(start, end),
                inputs=(hidden, weight, targets, g_lp, g_ent))


def _worker(rank: int, world: int, layouts: dict, out_path: str) -> None:
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    results: dict = {}
    if world == 2:
        results["op"] = _op_on_two_ranks(rank)
    for name, layout in layouts.items():
        for fused in (True, False):
            model_cfg = ModelConfig(family="qwen2", num_layers=2, tie_word_embeddings=layout["tied"],
                                    fused_logprobs=fused)
            groups = state.initialize(layout["tp"], layout["pp"], sequence_parallel=layout["sequence_parallel"])
            trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-3, clip_grad=1.0), groups,
                              TrainerOptions(micro_batch_tokens=48, logprob_temperature=0.8))
            trainer.load_full_state_dict(random_state_dict(model_cfg, seed=3))
            logprobs, entropy = trainer.forward_logprobs(_samples(), with_entropy=True)
            metrics = trainer.train_step(_samples(), _loss_with_entropy_bonus, with_entropy=True)
            results[(name, fused)] = dict(logprobs=logprobs, entropy=entropy, metrics=metrics,
                                          weights=trainer.full_state_dict())
            state.destroy()
    torch.save(results, f"{out_path}.{rank}")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused_tp")
    run_spawned(_worker, 1, SINGLE, str(out / "single.pt"))
    run_spawned(_worker, 2, LAYOUTS, str(out / "pair.pt"))
    single = torch.load(out / "single.pt.0", weights_only=False)
    pair = [torch.load(out / f"pair.pt.{r}", weights_only=False) for r in range(2)]
    return {**single, **pair[0]}, pair


def test_op_on_two_vocabulary_shards_matches_float64_reference(results):
    _, pair = results
    hidden, weight, targets, g_lp, g_ent = pair[0]["op"]["inputs"]
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = torch.log_softmax(h @ w.T / 0.8, dim=-1)
    lp = logp.gather(1, targets[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    for r in range(2):
        got = pair[r]["op"]
        assert torch.allclose(got["lp"].double(), lp.detach(), atol=2e-5)
        assert torch.allclose(got["ent"].double(), ent.detach(), atol=2e-5)
        assert torch.allclose(got["grad_hidden"].double(), h.grad, atol=1e-4)
        start, end = got["rows"]
        assert torch.allclose(got["grad_weight"].double(), w.grad[start:end], atol=1e-4)


@pytest.mark.parametrize("layout", sorted(SINGLE) + sorted(LAYOUTS))
def test_fused_equals_naive_in_the_trainer(results, layout):
    runs, _ = results
    fused, naive = runs[(layout, True)], runs[(layout, False)]
    for got, want in zip(fused["logprobs"], naive["logprobs"], strict=True):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    for got, want in zip(fused["entropy"], naive["entropy"], strict=True):
        assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    assert fused["metrics"]["loss"] == pytest.approx(naive["metrics"]["loss"], rel=1e-5, abs=1e-6)
    assert fused["metrics"]["grad_norm"] == pytest.approx(naive["metrics"]["grad_norm"], rel=1e-5)
    assert sorted(fused["weights"]) == sorted(naive["weights"])
    for key, want in naive["weights"].items():
        diff = (fused["weights"][key] - want).abs()
        assert diff.max().item() <= 5e-5, f"{key}: max abs diff {diff.max().item():.3e}"
        assert diff.mean().item() <= 1e-8, f"{key}: mean abs diff {diff.mean().item():.3e}"


@pytest.mark.parametrize("layout", sorted(SINGLE) + sorted(LAYOUTS))
def test_fused_step_moves_every_weight(results, layout):
    """Guards the comparison above against a step that changed nothing (e.g. no gradient
    reaching the output weight through the fused op)."""
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import random_state_dict

    runs, _ = results
    tied = {**SINGLE, **LAYOUTS}[layout]["tied"]
    initial = random_state_dict(ModelConfig(family="qwen2", num_layers=2, tie_word_embeddings=tied), seed=3)
    for key, value in runs[(layout, True)]["weights"].items():
        assert (value - initial[key]).abs().max() > 1e-5, f"{key} did not change"


def test_layouts_agree_with_single_process_on_the_fused_path(results):
    """Fused TP/PP runs against the fused single process (the naive ones are compared in test_parity)."""
    runs, _ = results
    ref = runs[("tp1", True)]
    for layout in LAYOUTS:
        if not LAYOUTS[layout]["tied"]:
            continue  # a different model (untied output layer)
        for got, want in zip(runs[(layout, True)]["logprobs"], ref["logprobs"], strict=True):
            assert torch.allclose(got, want, atol=2e-5)
        for key, want in ref["weights"].items():
            diff = (runs[(layout, True)]["weights"][key] - want).abs()
            assert diff.max().item() <= 5e-5 and diff.mean().item() <= 1e-8, key
