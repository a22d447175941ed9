"""GPU check of LoRA on the Transformer Engine spec (run on a GPU machine; skipped elsewhere).

There TE fuses the norms before linear_qkv and linear_fc1 into those layers (LayerNormColumnParallelLinear),
so the adapter recomputes the norm from the layer's own weights (models/lora.py, `_Norm`); the CPU path
(local spec, separate norms) never takes that branch. Fresh adapters leave the log-probs as they are; after
two updates at a large learning rate only the adapters moved, and a TE model without adapters loaded with the
merged weights gives the adapted model's log-probs (fp32; 5e-3 allows TF32 GEMMs, as
test_packed_attention_gpu.py; an adapter fed the un-normalised input is off by far more)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on a GPU machine)", allow_module_level=True)


def _adapters_merge_into_the_weights(cfg_fields: dict, adapters_expected: int, fused_norms: int) -> None:
    """Fresh adapters change nothing, two updates move them all, and a model without adapters that loads the
    merged weights computes the adapted model's log-probs, on the TE spec."""
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.gpt import te_available
    from megatron_rl.models.hf import random_state_dict
    from megatron_rl.models.lora import LoRAAdapter
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    if not te_available():
        pytest.skip("Transformer Engine is not installed")
    device = mdist.resolve_device("cuda")
    if not torch.distributed.is_initialized():
        mdist.init_distributed(mdist.dist_env_from({}), device)
    groups = state.initialize(1, 1, device=device)
    try:
        cfg = ModelConfig(**cfg_fields, dtype="float32", lora_rank=4, lora_alpha=32.0)
        full = random_state_dict(cfg, seed=7)
        gen = torch.Generator().manual_seed(0)
        samples = [Sample(torch.randint(0, cfg.vocab_size, (n,), generator=gen), torch.ones(n - 1))
                   for n in (37, 64, 12)]
        options = TrainerOptions(micro_batch_tokens=128)
        plain = Trainer(ModelConfig(**cfg_fields, dtype="float32"), OptimizerConfig(), groups, options)
        plain.load_full_state_dict(full)
        adapted = Trainer(cfg, OptimizerConfig(lr=1e-2), groups, options)
        assert adapted.use_te
        adapted.load_full_state_dict(full)
        adapters = [m for m in adapted.module.modules() if isinstance(m, LoRAAdapter)]
        assert len(adapters) == adapters_expected and sum(a.norm is not None for a in adapters) == fused_norms
        before = adapted.forward_logprobs(samples)[0]
        for fresh, base in zip(before, plain.forward_logprobs(samples)[0]):
            assert torch.allclose(fresh, base, atol=1e-6)
        for _ in range(2):
            adapted.train_step(samples)
        assert all(a.b.abs().max() > 0 for a in adapters)
        plain.load_full_state_dict(adapted.full_state_dict())
        moved = 0.0
        for lora, merged, fresh in zip(adapted.forward_logprobs(samples)[0], plain.forward_logprobs(samples)[0],
                                       before):
            assert torch.allclose(lora, merged, atol=5e-3), (lora - merged).abs().max()
            moved = max(moved, float((lora - fresh).abs().max()))
        assert moved > 0.05  # the adapters changed the model
    finally:
        state.destroy()


def test_lora_on_the_te_spec_merges_into_the_weights_the_engine_gets():
    # 2 layers x 4 targets; linear_qkv and linear_fc1 fuse their norm
    _adapters_merge_into_the_weights(dict(num_layers=2), adapters_expected=8, fused_norms=4)


def test_lora_on_the_experts_under_the_te_spec():
    """The experts' linears (TE's column / row parallel linears, SequentialMLP) and a shared expert's get
    adapters too: a Qwen2-MoE-style model with 4 experts, its gated shared expert and layer 1 dense. No norm is
    fused there (a sparse layer keeps pre_mlp_layernorm apart), only before layer 1's dense linear_fc1 and every
    linear_qkv."""
    model = dict(family="qwen2_moe", num_layers=2, tie_word_embeddings=False, num_experts=4, moe_ffn_hidden_size=64,
                 moe_shared_expert_intermediate_size=96, moe_router_topk=2, moe_norm_topk_prob=False,
                 moe_dense_layers=[1],
                 lora_targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "experts.linear_fc1",
                               "experts.linear_fc2", "shared_experts.linear_fc1", "shared_experts.linear_fc2"])
    # layer 0: 2 attention + 4 x 2 expert + 2 shared; layer 1: 2 attention + 2 dense
    _adapters_merge_into_the_weights(model, adapters_expected=16, fused_norms=3)
