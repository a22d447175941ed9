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
