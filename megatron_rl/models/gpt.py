"""Build the Megatron GPT model for the Llama / Qwen2 / Qwen3 dense families.

One architecture description (`ModelConfig`: RMSNorm, SwiGLU, RoPE theta, GQA, Qwen2 QKV
bias, Qwen3 QK-norm, tied or untied embeddings) becomes a Megatron `TransformerConfig`
and a `GPTModel` stage for this rank's pipeline position. The local layer spec is used
on CPU; the Transformer Engine spec when TE is importable and the device is a GPU.
The same description converts to and from a Hugging Face `config.json`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from megatron_rl.parallel.state import ParallelGroups

logger = logging.getLogger(__name__)

_HF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def hf_config_dict(model_cfg: Any, eos_token_id: int = 0) -> dict[str, Any]:
    """The HF `config.json` of this architecture (what `transformers` needs to build it)."""
    family = model_cfg.family
    cfg: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURE[family]],
        "model_type": _HF_MODEL_TYPE[family],
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.hidden_size,
        "intermediate_size": model_cfg.ffn_hidden_size,
        "num_hidden_layers": model_cfg.num_layers,
        "num_attention_heads": model_cfg.num_attention_heads,
        "num_key_value_heads": model_cfg.num_query_groups,
        "head_dim": model_cfg.resolved_head_dim,
        "max_position_embeddings": model_cfg.max_position_embeddings,
        "rope_theta": model_cfg.rope_theta,
        "rms_norm_eps": model_cfg.norm_eps,
        "tie_word_embeddings": model_cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": model_cfg.dtype,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "attention_dropout": 0.0,
    }
    if family == "llama":
        cfg["attention_bias"] = model_cfg.resolved_qkv_bias
        cfg["mlp_bias"] = False
    if family == "qwen3":
        cfg["attention_bias"] = model_cfg.resolved_qkv_bias
    return cfg


def arch_from_hf_config(path: str | Path) -> dict[str, Any]:
    """ModelConfig field values read from an HF checkpoint's config.json.

    Raises ValueError naming the file when the family or a feature is not supported.
    """
    cfg_path = Path(path) / "config.json"
    with open(cfg_path) as f:
        hf = json.load(f)
    model_type = hf.get("model_type")
    family = {v: k for k, v in _HF_MODEL_TYPE.items()}.get(model_type)
    if family is None:
        raise ValueError(f"{cfg_path}: model_type={model_type!r} is not supported; "
                         f"supported: {sorted(_HF_MODEL_TYPE.values())}")
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
        raise ValueError(f"{cfg_path}: rope_scaling={rope_scaling} is not supported yet (only default RoPE)")
    heads = hf["num_attention_heads"]
    qkv_bias = {"qwen2": True}.get(family, bool(hf.get("attention_bias", False)))
    return {
        "family": family,
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads", heads),
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "rope_theta": float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": qkv_bias,
        "qk_layernorm": family == "qwen3",
    }


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(model_cfg: Any, groups: ParallelGroups, *, deterministic: bool = False):
    """Megatron `TransformerConfig` for this architecture and parallel layout."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    on_gpu = groups.device.type != "cpu"
    dtype = torch_dtype(model_cfg.dtype)
    return TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.resolved_head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_cfg.resolved_qkv_bias,
        qk_layernorm=model_cfg.resolved_qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=groups.tp_size,
        pipeline_model_parallel_size=groups.pp_size,
        context_parallel_size=groups.cp_size,
        sequence_parallel=groups.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        # Fusions that need CUDA kernels stay off on CPU.
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        deterministic_mode=deterministic and on_gpu,
    )


def layer_spec(model_cfg: Any, use_te: bool):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model_cfg.resolved_qk_layernorm)
    return get_gpt_layer_local_spec(qk_layernorm=model_cfg.resolved_qk_layernorm, normalization="RMSNorm")


def build_model(model_cfg: Any, groups: ParallelGroups, *, deterministic: bool = False,
                use_te: bool | None = None):
    """This rank's pipeline stage of the GPT model, on `groups.device`, with random init.

    Weights are set afterwards from a full state dict (see `megatron_rl.weight_sync.sharding`).
    """
    from megatron.core.models.gpt import GPTModel

    if use_te is None:
        use_te = groups.device.type != "cpu" and te_available()
    config = transformer_config(model_cfg, groups, deterministic=deterministic)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(model_cfg, use_te),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,  # logits stay vocab-parallel: never gathered to the full vocabulary
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model_cfg.rope_theta),
    )
    return model.to(groups.device)
