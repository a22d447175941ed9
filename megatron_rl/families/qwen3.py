"""Qwen3 (dense): RMS-normed queries and keys per head (QK-norm), no bias by default (HF attention_bias: on
q, k, v and o_proj)."""

from megatron_rl.families.spec import FamilySpec

SPECS = (FamilySpec("qwen3", "Qwen3", "qwen3:Qwen3Converter", qk_layernorm=True, attention_bias_all=True,
                    sglang_ties_embeddings=True),)
