"""Activation recomputation (model.recompute): the layers really run again in the backward
pass (counted with forward hooks: full recompute runs every layer's forward twice per
training step, selective runs the core attention twice), and the results do not change:
loss, gradient norm and the weights after an optimizer step equal those without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_spawned

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _worker(rank: int, world: int, out_path: str) -> None:
    import dataclasses

    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=60)
    groups = state.initialize(1, 1)
    base = ModelConfig(num_layers=2)
    full = random_state_dict(base, seed=5)
    gen = torch.Generator().manual_seed(2)
    samples = [Sample(torch.randint(0, 128, (n,), generator=gen), torch.ones(n - 1)) for n in (9, 14, 6)]
    out = {}
    for mode in ("none", "selective", "full"):
        trainer = Trainer(dataclasses.replace(base, recompute=mode), OptimizerConfig(lr=1e-2), groups,
                          TrainerOptions(micro_batch_tokens=64))
        trainer.load_full_state_dict(full)
        calls = {"layer": 0, "core_attention": 0}
        for name, module in trainer.module.named_modules():
            if name.endswith("layers.0"):
                module.register_forward_hook(lambda *_: calls.__setitem__("layer", calls["layer"] + 1))
            if name.endswith("layers.0.self_attention.core_attention"):
                module.register_forward_hook(lambda *_: calls.__setitem__("core_attention",
                                                                            calls["core_attention"] + 1))
        metrics = trainer.train_step(samples)
        weights = torch.cat([p.detach().flatten() for p in trainer.module.parameters()])
        out[mode] = {"calls": calls, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                     "weights": weights.tolist()[:2000]}
    Path(out_path).write_text(json.dumps(out))


def test_recompute_reruns_layers_and_changes_nothing(tmp_path):
    path = tmp_path / "out.json"
    run_spawned(_worker, 1, str(path))
    out = json.loads(path.read_text())
    assert out["none"]["calls"] == {"layer": 1, "core_attention": 1}
    assert out["selective"]["calls"] == {"layer": 1, "core_attention": 2}
    assert out["full"]["calls"] == {"layer": 2, "core_attention": 2}
    for mode in ("selective", "full"):
        assert out[mode]["loss"] == out["none"]["loss"] and out[mode]["grad_norm"] == out["none"]["grad_norm"]
        assert out[mode]["weights"] == out["none"]["weights"]
