"""A bf16 model on the CPU, and Megatron's local spec in bf16.

A bf16 model on Megatron's local spec (the CPU path, and model.transformer_impl=local on a GPU) holds every
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


def _train_worker(rank: int, world: int, dtype: str, out_path: str) -> None:
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=60)
    groups = state.initialize(1, 1)
    torch.manual_seed(0)
    trainer = Trainer(ModelConfig(family="llama", num_layers=2, dtype=dtype, tie_word_embeddings=False),
                      OptimizerConfig(lr=1e-3), groups, TrainerOptions(micro_batch_tokens=64, total_steps=10))
    trainer.initialize_weights()
    gen = torch.Generator().manual_seed(1)
    samples = [Sample(torch.randint(0, 99, (20,), generator=gen), torch.ones(19)) for _ in range(4)]
    losses = [trainer.train_step(samples)["loss"] for _ in range(5)]
    inner = trainer.optimizer.chained_optimizers[0] if hasattr(trainer.optimizer, "chained_optimizers") \
        else trainer.optimizer
    masters = [p.dtype for group in getattr(inner, "fp32_from_float16_groups", []) for p in group]
    Path(out_path).write_text(json.dumps({
        "losses": losses, "params": sorted({str(p.dtype) for p in trainer.module.parameters()}),
        "masters": sorted({str(d) for d in masters}), "optimizer": type(inner).__name__}))


def test_a_bf16_model_trains_on_the_cpu_with_fp32_master_weights_and_tracks_fp32(tmp_path):
    """model.dtype=bfloat16 on the CPU: Megatron's mixed-precision optimizer (fp32 master copies of the bf16
    parameters) runs with the CPU layer's float16_optimizer_cpu_params patch (before it, the optimizer raised
    TypeError on CPU tensors after the run directory existed). Five steps from the same initial weights give
    the fp32 run's losses within bf16's precision (observed ~1e-3 apart, the losses falling by ~1.5)."""
    got = {}
    for dtype in ("float32", "bfloat16"):
        run_spawned(_train_worker, 1, dtype, str(tmp_path / f"{dtype}.json"))
        got[dtype] = json.loads((tmp_path / f"{dtype}.json").read_text())
    bf16, fp32 = got["bfloat16"], got["float32"]
    assert bf16["params"] == ["torch.bfloat16"] and bf16["masters"] == ["torch.float32"]
    assert bf16["optimizer"] == "Float16OptimizerWithFloat16Params"
    assert fp32["losses"][0] - fp32["losses"][-1] > 0.5  # it learns, so the comparison means something
    for a, b in zip(bf16["losses"], fp32["losses"], strict=True):
        assert abs(a - b) <= 2e-2 * abs(b), (bf16["losses"], fp32["losses"])
