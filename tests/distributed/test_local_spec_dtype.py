"""A bf16 model on Megatron's local spec (the CPU path, and model.transformer_impl=local on a GPU) holds every
weight in bf16: Megatron builds its torch norms in fp32 whatever params_dtype is (Megatron-LM casts them with
its Float16Module wrapper, which this project does not use), and torch's fused RMSNorm kernel refuses bf16 input
with an fp32 weight (it warns and falls back, measured on an H200). Run in a spawned rank: building a model
needs a process group and Megatron's parallel state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _worker(rank: int, world: int, out_path: str) -> None:
    import warnings

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.gpt import build_model
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=60)
    groups = state.initialize(1, 1)
    # (a bf16 trainer needs CUDA: Megatron's mixed-precision optimizer takes CUDA tensors only)
    model = build_model(ModelConfig(family="qwen3", num_layers=2, dtype="bfloat16"), groups)  # query/key norms too
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [norm(torch.randn(3, norm.weight.shape[0], dtype=torch.bfloat16)) for norm in norms]
    Path(out_path).write_text(json.dumps({
        "norms": len(norms),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "mismatch_warnings": [str(w.message) for w in caught if "Mismatch dtype" in str(w.message)],
        "output_dtypes": sorted({str(o.dtype) for o in outputs}),
    }))


def test_a_bf16_local_spec_model_holds_its_norms_in_bf16(tmp_path):
    out = tmp_path / "out.json"
    run_spawned(_worker, 1, str(out))
    got = json.loads(out.read_text())
    assert got["norms"] == 2 * 4 + 1  # per layer: input, pre-MLP, query, key; the final norm
    assert got["dtypes"] == ["torch.bfloat16"]
    assert got["mismatch_warnings"] == []
    assert got["output_dtypes"] == ["torch.bfloat16"]
