"""Qwen2 and Qwen2.5: Llama's layers with a bias on the Q/K/V projections (not on o_proj)."""

from megatron_rl.families.spec import FamilySpec

SPECS = (FamilySpec("qwen2", "Qwen2", "qwen2:Qwen2Converter", qkv_bias=True, sglang_ties_embeddings=True),)
