"""Context parallelism mixed with the other layouts, on four ranks, agrees with the single-
process run of the same model and batch (same worker, samples and tolerances as
`test_parity.py`, whose two-rank run covers CP=2 alone): CP=2 x TP=2 with sequence
parallelism, CP=2 x PP=2, CP=2 x DP=2 with the distributed optimizer; and a Qwen3-MoE model
at CP=2 x EP=2 against its own single-process run (worker and tolerances of
`test_moe_parity.py`: the experts see each rank's share of the row's tokens)."""

from __future__ import annotations

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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logprobs_and_entropy_match_single_process(results, layout):
    ref, runs = results
    for got, want in zip(runs[layout]["logprobs"], ref["logprobs"], strict=True):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
    for got, want in zip(runs[layout]["entropy"], ref["entropy"], strict=True):
        assert torch.allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_grad_norm_and_updated_weights_match_single_process(results, layout):
    ref, runs = results
    got, want = runs[layout]["metrics"], ref["metrics"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["num_tokens"] == want["num_tokens"]
    for key in ref["weights"]:
        diff = (runs[layout]["weights"][key] - ref["weights"][key]).abs().max().item()
        assert diff <= 1e-6, f"{key}: max abs diff {diff:.3e}"


def test_mixture_of_experts_at_cp2_ep2_matches_single_process(tmp_path):
    run_spawned(moe._worker, 1, {"ref": moe.REFERENCE}, str(tmp_path / "ref.pt"))
    run_spawned(moe._worker, 4, {"cp2_ep2": MOE_LAYOUT}, str(tmp_path / "cp.pt"), timeout_s=800)
    ref, got = torch.load(tmp_path / "ref.pt")["ref"], torch.load(tmp_path / "cp.pt")["cp2_ep2"]
    for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
        assert torch.allclose(a, b, atol=2e-5), (a - b).abs().max()
    assert got["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-6, abs=1e-6)
    assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    for key in ref["weights"]:
        diff = (got["weights"][key] - ref["weights"][key]).abs().max().item()
        assert diff <= 1e-5, f"{key}: max abs diff {diff:.3e}"
