"""GPU check of packed rows on the Transformer Engine spec (run on a GPU machine; skipped
elsewhere). TE's causal attention ignores a dense mask, so the trainer hands it the row's
`cu_seqlens` (THD layout): samples packed into one row must get the same log-probs as each
sample in a row of its own, and as `transformers`' model on the same weights (fp32; 5e-3
allows TF32 GEMMs; a sample that saw its row neighbours is off by ~1e-2 on the CPU path).

Also for a GLM-4.5-style mixture of experts with a dense first layer: on the TE spec the dense
layer's norm is fused into its `linear_fc1` while the MoE layers keep `pre_mlp_layernorm`
(`weight_sync.sharding.canonical_name` maps both to the converters' names), and tokens travel
with the all-to-all dispatcher, which the CPU path never uses. And for a DeepSeek-V3-style model:
multi-latent attention on TE (replicated down projections, latent norms fused into the up
projections, keys and values of different widths in TE's THD attention) with YaRN. And for a gpt-oss-style
model: TE's attention with learned sinks and sliding windows over THD rows."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_gpt_oss import ARCH as GPT_OSS

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on a GPU machine)", allow_module_level=True)


MODELS = {"qwen2": dict(num_layers=2),
          "glm4_moe": dict(family="glm4_moe", num_layers=3, num_experts=4, moe_ffn_hidden_size=64,
                           moe_shared_expert_intermediate_size=64, moe_dense_layers=[0], rotary_percent=0.5,
                           tie_word_embeddings=False),
          "deepseek_v3": dict(family="deepseek_v3", num_layers=3, num_query_groups=4, num_experts=4,
                              moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64, moe_dense_layers=[0],
                              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                              rope_scaling_factor=8.0, max_position_embeddings=512,
                              rope_scaling_original_max_position_embeddings=64, rope_scaling_mscale=1.0,
                              rope_scaling_mscale_all_dim=1.0, tie_word_embeddings=False),
          # gpt-oss: TE's attention with sinks (softmax_type learnable) and a 16-token window in layers 0 and 2
          # over THD rows, biased experts, YaRN on GPTModel
          # (heads 64 wide, as gpt-oss's: cuDNN before 9.26 trains sinks wrongly for 32: models/gpt.py)
          "gpt_oss": {k: v for k, v in GPT_OSS.items() if k != "num_layers"} | dict(
              num_layers=3, sliding_window_layers=[0, 2], head_dim=64)}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_packed_rows_keep_samples_apart_on_the_te_spec(model):
    from megatron_rl.config.schema import ModelConfig, OptimizerConfig
    from megatron_rl.models.gpt import te_available
    from megatron_rl.models.hf import build_hf_model, random_state_dict
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    if not te_available():
        pytest.skip("Transformer Engine is not installed")
    device = mdist.resolve_device("cuda")
    mdist.init_distributed(mdist.dist_env_from({}), device)
    groups = state.initialize(1, 1, device=device)
    cfg = ModelConfig(**MODELS[model], dtype="float32")
    full = random_state_dict(cfg, seed=7)
    gen = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, cfg.vocab_size, (n,), generator=gen), torch.ones(n - 1))
               for n in (37, 64, 12, 90)]
    results = []
    for budget in (90, 512):  # one sample per row, then all four in one row
        trainer = Trainer(cfg, OptimizerConfig(), groups, TrainerOptions(micro_batch_tokens=budget))
        assert trainer.use_te
        trainer.load_full_state_dict(full)
        results.append(trainer.forward_logprobs(samples)[0])
    hf = build_hf_model(cfg, seed=7).to(device)
    for sample, alone, packed in zip(samples, *results):
        with torch.no_grad():
            logits = hf(sample.tokens[None].to(device)).logits[0, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, sample.tokens[1:, None].to(device))[:, 0].cpu()
        assert torch.allclose(packed, alone, atol=5e-3), (packed - alone).abs().max()
        assert torch.allclose(alone, expected, atol=5e-3), (alone - expected).abs().max()
