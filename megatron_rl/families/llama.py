"""Llama (Llama 2, 3, 3.1, 3.2): grouped-query attention, SwiGLU MLPs, RoPE with Llama 3.1's scaling or YaRN;
HF attention_bias puts a bias on q, k, v and o_proj, mlp_bias on the MLP's three projections."""

from megatron_rl.families.spec import FamilySpec

SPECS = (FamilySpec("llama", "Llama", "llama:LlamaConverter", attention_bias_all=True, mlp_bias=True,
                    sglang_ties_embeddings=True),)
