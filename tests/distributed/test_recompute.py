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


MODELS = {"qwen2": dict(num_layers=2),
          # multi-latent attention: the local spec's own core attention (MaskedAttention) is what reruns
          "deepseek_v3": dict(family="deepseek_v3", num_layers=2, num_query_groups=4, tie_word_embeddings=False,
                              num_experts=4, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64,
                              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                              v_head_dim=24)}


def _worker(rank: int, world: int, model: str, out_path: str) -> None:
    import dataclasses

    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=60)
    groups = state.initialize(1, 1)
    base = ModelConfig(**MODELS[model])
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


@pytest.mark.parametrize("model", sorted(MODELS))
def test_recompute_reruns_layers_and_changes_nothing(tmp_path, model):
    path = tmp_path / "out.json"
    run_spawned(_worker, 1, model, str(path))
    out = json.loads(path.read_text())
    assert out["none"]["calls"] == {"layer": 1, "core_attention": 1}
    assert out["selective"]["calls"] == {"layer": 1, "core_attention": 2}
    assert out["full"]["calls"] == {"layer": 2, "core_attention": 2}
    for mode in ("selective", "full"):
        assert out[mode]["loss"] == out["none"]["loss"] and out[mode]["grad_norm"] == out["none"]["grad_norm"]
        assert out[mode]["weights"] == out["none"]["weights"]
