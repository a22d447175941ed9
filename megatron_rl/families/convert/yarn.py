"""YaRN rope scaling between HF's `rope_parameters` (rope_type "yarn") and ModelConfig's rope_scaling_*
fields, for the families that scale RoPE with it (DeepSeek-V2/-V3, gpt-oss).

Both sides compute the same thing from the same parameters (transformers' _compute_yarn_parameters,
Megatron-core's YarnRotaryEmbedding): frequencies ramped between the original and the divided ones over
the correction range from beta_fast and beta_slow (rounded to whole dimensions unless `truncate` is false),
and cos and sin multiplied by an attention factor derived from factor, mscale and mscale_all_dim. An
explicit `attention_factor` is refused unless it is the derived one, which is the only one Megatron-core
applies.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# (HF key, ModelConfig field, HF's and ModelConfig's default when the key is absent)
YARN_KEYS = (("beta_fast", "rope_scaling_beta_fast", 32.0), ("beta_slow", "rope_scaling_beta_slow", 1.0),
             ("mscale", "rope_scaling_mscale", 1.0), ("mscale_all_dim", "rope_scaling_mscale_all_dim", 0.0))
# every rope field, so that a config file's YaRN values never survive a checkpoint that has none
NO_YARN = {"rope_scaling_factor": None, "rope_scaling_original_max_position_embeddings": 8192,
           "rope_scaling_truncate": True, **{key: default for _, key, default in YARN_KEYS}}


def attention_factor(fields: dict[str, Any]) -> float:
    """The cos/sin scale both sides derive (transformers' get_mscale ratio; ModelConfig refuses the cases
    where they would not agree)."""
    def mscale(factor: float, m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor, m, m_all = (fields[f"rope_scaling_{k}"] for k in ("factor", "mscale", "mscale_all_dim"))
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor, 1.0)


def yarn_fields(rope: dict[str, Any], where: Path) -> dict[str, Any]:
    """ModelConfig's rope_scaling_* fields from a YaRN `rope_parameters` / `rope_scaling` entry."""
    fields = {"rope_scaling_factor": float(rope["factor"]),
              "rope_scaling_original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
              "rope_scaling_truncate": bool(rope.get("truncate", True))}
    if rope.get("mscale_all_dim") and rope.get("mscale") is None:
        # transformers then scales cos and sin by 0.1 ln(factor) + 1 and reads mscale_all_dim only in DeepSeek's
        # softmax scale; Megatron-core applies mscale / mscale_all_dim to both: no field values agree with it
        raise ValueError(f"{where}: rope_parameters mscale_all_dim={rope['mscale_all_dim']} without mscale is not "
                         "supported: transformers and Megatron-core would scale attention differently (give both, "
                         "as DeepSeek-V3's 1.0 and 1.0, or neither)")
    for hf_key, key, default in YARN_KEYS:
        value = rope.get(hf_key)
        fields[key] = float(default if value is None else value)
    given = rope.get("attention_factor")
    if given is not None:
        derived = attention_factor(fields)
        if abs(float(given) - derived) > 1e-9:
            raise ValueError(f"{where}: rope_parameters attention_factor={given} differs from the {derived:.6g} "
                             "that mscale and mscale_all_dim give, the only one Megatron-core's YaRN applies")
    return fields


def yarn_rope_parameters(arch: Any) -> dict[str, Any]:
    """HF's YaRN `rope_parameters` entries (without rope_theta) of `arch`; `truncate` only when false, the
    mscale keys only when either differs from its default (absent, both mean the defaults' factor)."""
    rope: dict[str, Any] = {"rope_type": "yarn", "factor": arch.rope_scaling_factor,
                            "original_max_position_embeddings": arch.rope_scaling_original_max_position_embeddings}
    mscales = any(getattr(arch, key) != default for hf_key, key, default in YARN_KEYS if hf_key.startswith("mscale"))
    for hf_key, key, _ in YARN_KEYS:
        if hf_key.startswith("beta") or mscales:
            rope[hf_key] = getattr(arch, key)
    if not arch.rope_scaling_truncate:
        rope["truncate"] = False
    return rope


def rope_fields(rope: dict[str, Any], where: Path) -> dict[str, Any]:
    """ModelConfig's rope_scaling_* fields from a `rope_parameters` / `rope_scaling` entry that is plain RoPE
    or YaRN (any other type is refused naming the file)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"{where}: rope_scaling={rope} is not supported (only default RoPE and YaRN)")
    return yarn_fields(rope, where) if rope_type == "yarn" else dict(NO_YARN)


class YarnRope:
    """Mixed in before `DenseDecoderConverter` by the families whose rope scaling is YaRN: `config_dict`
    writes `rope_parameters(arch, theta)`, `arch_from_config` reads `rope_fields`; the dense layout's Llama 3.1
    reading is off."""

    @staticmethod
    def rope_parameters(arch: Any, theta: float) -> dict[str, Any]:
        """HF's `rope_parameters` of `arch`: plain RoPE, or YaRN's entries."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        if arch.rope_scaling_factor is not None:
            rope.update(yarn_rope_parameters(arch))
        return rope

    @staticmethod
    def _rope_scaling_fields(hf: dict[str, Any], where: Path) -> dict[str, Any]:
        return {"rope_scaling_factor": None}  # YaRN: arch_from_config, with rope_fields
