"""Name and layout mapping between Hugging Face and Megatron (full, unsharded) state dicts for
the dense Llama / Qwen2 / Qwen3 families.

The families differ only in optional tensors (Qwen2's QKV bias, Qwen3's q/k norms), so one
mapping serves all three. Megatron fuses Q, K and V into one `linear_qkv` whose rows are
grouped per KV group: [q (heads_per_group * head_dim), k (head_dim), v (head_dim)] x groups;
it fuses SwiGLU's gate and up projections into `linear_fc1` = [gate; up].
Names use the local layer spec; `te_names` renames for the Transformer Engine spec.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor


def _qkv_fuse(q: Tensor, k: Tensor, v: Tensor, groups: int) -> Tensor:
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, -1, *rest)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_split(qkv: Tensor, heads: int, groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    rest = qkv.shape[1:]
    per_group = qkv.reshape(groups, (heads // groups + 2) * head_dim, *rest)
    q, k, v = torch.split(per_group, [heads // groups * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, Tensor], arch: Any) -> dict[str, Tensor]:
    """Full Megatron state dict (local-spec names) from a full HF state dict."""
    groups = arch.num_query_groups
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        att = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _qkv_fuse(
            hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"], groups)
        if arch.resolved_qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _qkv_fuse(
                hf[att + "q_proj.bias"], hf[att + "k_proj.bias"], hf[att + "v_proj.bias"], groups)
        if arch.resolved_qk_layernorm:
            out[m + "self_attention.q_layernorm.weight"] = hf[att + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[att + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[att + "o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], dim=0)
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(meg: dict[str, Tensor], arch: Any) -> dict[str, Tensor]:
    """Full HF state dict from a full Megatron state dict (local-spec names)."""
    heads, groups, head_dim = arch.num_attention_heads, arch.num_query_groups, arch.resolved_head_dim
    out = {"model.embed_tokens.weight": meg["embedding.word_embeddings.weight"],
           "model.norm.weight": meg["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = meg["embedding.word_embeddings.weight" if arch.tie_word_embeddings
                                else "output_layer.weight"]
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        att = h + "self_attn."
        out[h + "input_layernorm.weight"] = meg[m + "input_layernorm.weight"]
        q, k, v = _qkv_split(meg[m + "self_attention.linear_qkv.weight"], heads, groups, head_dim)
        out[att + "q_proj.weight"], out[att + "k_proj.weight"], out[att + "v_proj.weight"] = q, k, v
        if arch.resolved_qkv_bias:
            q, k, v = _qkv_split(meg[m + "self_attention.linear_qkv.bias"], heads, groups, head_dim)
            out[att + "q_proj.bias"], out[att + "k_proj.bias"], out[att + "v_proj.bias"] = q, k, v
        if arch.resolved_qk_layernorm:
            out[att + "q_norm.weight"] = meg[m + "self_attention.q_layernorm.weight"]
            out[att + "k_norm.weight"] = meg[m + "self_attention.k_layernorm.weight"]
        out[att + "o_proj.weight"] = meg[m + "self_attention.linear_proj.weight"]
        out[h + "post_attention_layernorm.weight"] = meg[m + "pre_mlp_layernorm.weight"]
        gate, up = meg[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = meg[m + "mlp.linear_fc2.weight"]
    return out


def te_names(name: str) -> str:
    """Local-spec name -> Transformer Engine spec name (norms fused into the next linear)."""
    return (name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
                .replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))
