"""Qwen3-MoE: Qwen3's attention, a softmax router over routed SwiGLU experts without shared ones (dense
layers where HF mlp_only_layers says)."""

from megatron_rl.families.spec import FamilySpec

SPECS = (FamilySpec("qwen3_moe", "Qwen3-MoE", "qwen3_moe:Qwen3MoeConverter", moe=True, qk_layernorm=True,
                    attention_bias_all=True),)
