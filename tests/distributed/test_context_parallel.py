"""Context parallelism against the single-process (CP=1) computation.

The chunked attention itself (`models/local_attention.py:AllGatherContextAttention`) on CP=2
and CP=3 ranks: each rank's outputs and its query, key and value gradients (the keys' and values'
come back through the all-gather's reduce-scatter) against dense masked attention over the whole
row, written out by hand in float64 here; packed segments of one chunk per rank, of several, and
trailing padding; grouped-query and multi-latent (key and value widths differ) heads; with
PyTorch's CPU flash-attention kernels per block and with the plain tensor operations the path
uses off CPU.

The model at CP=2 and CP=3 against its CP=1 run (the default single-rank path,
`PackedAttention`), on rows that pack several samples, some shorter than one chunk and of
lengths divisible by neither the chunk nor cp: the log-probs of every sample, the loss and
every parameter's gradient.

Context parallelism mixed with the other layouts, on four ranks, agrees with the single-
process run of the same model and batch (same worker, samples and tolerances as
`test_parity.py`, whose two-rank run covers CP=2 alone): CP=2 x TP=2 with sequence
parallelism, CP=2 x PP=2, CP=2 x DP=2 with the distributed optimizer; and a Qwen3-MoE model
at CP=2 x EP=2 against its own single-process run (worker and tolerances of
`test_moe_parity.py`: the experts see each rank's share of the row's tokens)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.distributed.launcher import run_spawned
from tests.distributed import test_moe_parity as moe
from tests.distributed.test_parity import REFERENCE, _worker

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

LAYOUTS = {
    "cp2_tp2_sp": dict(tp=2, pp=1, cp=2, sequence_parallel=True, distopt=False),
    "cp2_pp2": dict(tp=1, pp=2, cp=2, sequence_parallel=False, distopt=False),
    "cp2_dp2_distopt": dict(tp=1, pp=1, cp=2, sequence_parallel=False, distopt=True),
}
MOE_LAYOUT = dict(tp=1, pp=1, cp=2, ep=2, sequence_parallel=False, distopt=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    run_spawned(_worker, 1, {"ref": REFERENCE}, str(out / "ref.pt"))
    run_spawned(_worker, 4, LAYOUTS, str(out / "layouts.pt"), timeout_s=800)
    return torch.load(out / "ref.pt")["ref"], torch.load(out / "layouts.pt")


def _assert_matches(got: dict, ref: dict, weight_atol: float) -> None:
    """One layout's run against the single-process run: log-probs and entropies, loss, gradient
    norm, tokens, and every weight after the step (the tolerances of test_parity.py and
    test_moe_parity.py, whose weight bound each worker's docstring explains)."""
    for name in ("logprobs", "entropy"):
        for a, b in zip(got[name], ref[name], strict=True):
            assert a.shape == b.shape
            assert torch.allclose(a, b, atol=2e-5), (name, (a - b).abs().max())
    assert got["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-6, abs=1e-6)
    assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    assert got["metrics"]["num_tokens"] == ref["metrics"]["num_tokens"]
    assert sorted(got["weights"]) == sorted(ref["weights"])
    for key in ref["weights"]:
        diff = (got["weights"][key] - ref["weights"][key]).abs().max().item()
        assert diff <= weight_atol, f"{key}: max abs diff {diff:.3e}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(results, layout):
    ref, runs = results
    _assert_matches(runs[layout], ref, weight_atol=1e-6)


def test_mixture_of_experts_at_cp2_ep2_matches_single_process(tmp_path):
    run_spawned(moe._worker, 1, "qwen3_moe", {"ref": moe.REFERENCE}, str(tmp_path / "ref.pt"))
    run_spawned(moe._worker, 4, "qwen3_moe", {"cp2_ep2": MOE_LAYOUT}, str(tmp_path / "cp.pt"), timeout_s=800)
    ref, got = torch.load(tmp_path / "ref.pt")["ref"], torch.load(tmp_path / "cp.pt")["cp2_ep2"]
    _assert_matches(got, ref, weight_atol=1e-5)


# -- the chunked attention alone ------------------------------------------------------------------------------

def _segment_lengths(cp: int) -> list[int]:
    """A packed row's segments (each a multiple of 2 * cp, as `pack` pads them): one token per chunk, three,
    seven, one again, then trailing padding of two per chunk."""
    return [2 * cp * n for n in (1, 3, 7, 1, 2)]


def _attention_inputs(cp: int, k_width: int, v_width: int) -> dict:
    gen = torch.Generator().manual_seed(cp * 100 + k_width)
    rows = sum(_segment_lengths(cp))
    return dict(query=torch.randn(rows, 4, k_width, generator=gen, dtype=torch.float64),
                key=torch.randn(rows, 2, k_width, generator=gen, dtype=torch.float64),
                value=torch.randn(rows, 2, v_width, generator=gen, dtype=torch.float64),
                grad=torch.randn(rows, 4 * v_width, generator=gen, dtype=torch.float64))


# (blocks computed by: PyTorch's CPU flash kernels, or the plain operations of the path off CPU; key width,
# value width: grouped-query heads alike, or multi-latent attention's)
ATTENTION_CASES = [(kernel, k_width, v_width) for kernel in ("cpu_flash", "plain")
                   for k_width, v_width in ((8, 8), (12, 8))]


def _attention_worker(rank: int, world: int, out_path: str) -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models import local_attention
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.context_parallel import held_positions

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    state.initialize(1, 1, world)
    cu_seqlens = torch.tensor([0] + _segment_lengths(world)).cumsum(0)
    held = held_positions(cu_seqlens, world, rank)
    cpu_kernels = local_attention._block_forward, local_attention._block_backward
    results = {}
    for kernel, k_width, v_width in ATTENTION_CASES:
        if kernel == "plain":  # what the attention runs off CPU
            local_attention._block_forward = local_attention._plain_block_forward
            local_attention._block_backward = local_attention._plain_block_backward
        else:
            local_attention._block_forward, local_attention._block_backward = cpu_kernels
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                   kv_channels=k_width, attention_dropout=0.0, context_parallel_size=world)
        attention = local_attention.AllGatherContextAttention(config, 1, None, "self", k_channels=k_width,
                                                              v_channels=v_width)
        inputs = _attention_inputs(world, k_width, v_width)
        local = {name: inputs[name][held].clone().requires_grad_() for name in ("query", "key", "value")}
        out = attention(local["query"], local["key"], local["value"], None,
                        packed_seq_params=SimpleNamespace(cu_seqlens_q=cu_seqlens.int()))
        out.backward(inputs["grad"][held])
        results[(kernel, k_width, v_width)] = dict(out=out.detach(), **{n: t.grad for n, t in local.items()})
    torch.save(dict(held=held, results=results), f"{out_path}.{rank}")


def _dense_attention(query, key, value, lengths, scale):
    """Whole-row causal attention within each segment, scores formed and masked: [S, heads * v_width]."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    rows = segment.numel()
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(rows, rows, dtype=torch.bool).tril()
    key, value = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)  # heads 2g, 2g+1 share group g
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, value).reshape(rows, -1)


@pytest.mark.parametrize("cp", [2, 3])
def test_chunked_attention_matches_dense_attention_of_the_whole_row(tmp_path, cp):
    """Tolerance: float64 throughout, so 1e-10 absolute leaves rounding ~1e-15 a wide margin and still fails
    any misplaced block (differences of order 1)."""
    run_spawned(_attention_worker, cp, str(tmp_path / "attention"))
    ranks = [torch.load(tmp_path / f"attention.{rank}") for rank in range(cp)]
    for kernel, k_width, v_width in ATTENTION_CASES:
        inputs = {n: t.clone().requires_grad_(n != "grad") for n, t in _attention_inputs(cp, k_width, v_width).items()}
        expected = _dense_attention(inputs["query"], inputs["key"], inputs["value"], _segment_lengths(cp),
                                    1 / math.sqrt(k_width))
        expected.backward(inputs["grad"])
        for rank, got in enumerate(ranks):
            held, got = got["held"], got["results"][(kernel, k_width, v_width)]
            case = (kernel, k_width, v_width, rank)
            assert torch.allclose(got["out"], expected.detach()[held], rtol=0, atol=1e-10), case
            for name in ("query", "key", "value"):
                assert torch.allclose(got[name], inputs[name].grad[held], rtol=0, atol=1e-10), (case, name)


# -- the model ------------------------------------------------------------------------------------------------

# Rows of up to 96 tokens pack several samples each; 2 and 3 tokens are shorter than a chunk at CP=2 and CP=3
# (a segment is padded to 2 * cp, chunk = segment / (2 * cp)), and most lengths divide by neither.
UNEVEN_LENGTHS = (2, 37, 3, 61, 5, 94, 11, 23, 7, 50)


def _model_worker(rank: int, world: int, out_path: str) -> None:
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=120)
    model_cfg = ModelConfig(family="qwen2", num_layers=2, tie_word_embeddings=True)
    groups = state.initialize(1, 1, world)  # cp = world
    trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-3, clip_grad=0.0), groups, TrainerOptions(micro_batch_tokens=96))
    trainer.load_full_state_dict(random_state_dict(model_cfg, seed=3))
    gen = torch.Generator().manual_seed(1)
    samples = [Sample(torch.randint(0, 128, (n,), generator=gen), torch.ones(n - 1)) for n in UNEVEN_LENGTHS]
    logprobs, _ = trainer.forward_logprobs(samples)
    metrics = trainer.train_step(samples)
    # the gradient DDP reduced over the context-parallel ranks, as the optimizer took it (no clipping)
    grads = {name: param.main_grad.detach().clone() for name, param in trainer.module.named_parameters()}
    # prompt-heavy samples (the last 2 targets count): the ranks that hold only middle chunks have no loss target
    # in their shard, and still take part in the step and in the gathers of what was not computed (NaN)
    heavy = [Sample(torch.randint(0, 128, (n,), generator=gen), _last_targets(n, 2)) for n in HEAVY_LENGTHS]
    heavy_lp, _ = trainer.forward_logprobs(heavy, loss_targets_only=True)
    heavy_metrics = trainer.train_step(heavy, keep_logprobs=True)
    if rank == 0:
        torch.save(dict(logprobs=logprobs, metrics=metrics, grads=grads, heavy_logprobs=heavy_lp,
                        heavy_metrics=heavy_metrics, heavy_kept=trainer.last_logprobs), out_path)


HEAVY_LENGTHS = (12, 30, 45, 20)


def _last_targets(n: int, k: int) -> torch.Tensor:
    mask = torch.zeros(n - 1)
    mask[-k:] = 1.0
    return mask


@pytest.fixture(scope="module")
def uneven_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("uneven")
    for cp in (1, 2, 3):
        run_spawned(_model_worker, cp, str(out / f"cp{cp}.pt"))
    return {cp: torch.load(out / f"cp{cp}.pt") for cp in (1, 2, 3)}


@pytest.mark.parametrize("cp", [2, 3])
def test_uneven_packed_samples_match_cp1(uneven_runs, cp):
    """Log-probs and loss to the tolerances of test_parity.py (fp32, reductions reordered). Gradients: each
    parameter's to 1e-5 of its largest entry, where fp32 rounding of sums reordered over ranks is ~1e-6 of it
    and a wrong attention block moves it by far more."""
    ref, got = uneven_runs[1], uneven_runs[cp]
    assert [lp.numel() for lp in ref["logprobs"]] == [n - 1 for n in UNEVEN_LENGTHS]
    for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=2e-5), (a - b).abs().max()
    assert got["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-6, abs=1e-6)
    assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for name, want in ref["grads"].items():
        assert want.abs().max() > 0, f"{name}: no gradient in the reference"
        diff = (got["grads"][name] - want).abs().max()
        assert diff <= 1e-5 * want.abs().max(), f"{name}: max abs diff {diff:.3e} of {want.abs().max():.3e}"


@pytest.mark.parametrize("cp", [2, 3])
def test_ranks_without_loss_targets_take_part(uneven_runs, cp):
    """Each prompt-heavy sample's last 2 targets sit in its last chunk, held by rank 0: the other ranks' shards
    have no loss target. The log-probs of the loss targets (loss_targets_only, and those train_step keeps) equal
    CP=1's, NaN elsewhere; the step's loss and gradient norm equal CP=1's."""
    ref, got = uneven_runs[1], uneven_runs[cp]
    for key in ("heavy_logprobs", "heavy_kept"):
        for n, a, b in zip(HEAVY_LENGTHS, got[key], ref[key], strict=True):
            counted = _last_targets(n, 2).bool()
            assert torch.allclose(a[counted], b[counted], atol=2e-5), (key, (a - b)[counted].abs().max())
            assert torch.isnan(a[~counted]).all() and torch.isnan(b[~counted]).all(), key
    assert got["heavy_metrics"]["loss"] == pytest.approx(ref["heavy_metrics"]["loss"], rel=1e-5, abs=1e-6)
    assert got["heavy_metrics"]["grad_norm"] == pytest.approx(ref["heavy_metrics"]["grad_norm"], rel=1e-5)
