"""Qwen2 and Qwen2.5: Llama's layers with a bias on the Q/K/V projections (not on o_proj).

HF <-> Megatron conversion. Qwen2 / Qwen2.5: Q, K and V projections always carry a bias (the output projection never);
sliding-window attention is refused (the released dense models do not enable it, and with
`use_sliding_window` false transformers ignores `sliding_window` and `max_window_layers`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.families.convert.dense import DenseDecoderConverter
from megatron_rl.families.spec import FamilySpec


# The keys of Qwen's sliding-window attention, which every Qwen family refuses: transformers applies a window
# only with use_sliding_window (configuration_qwen2.py: sliding_window is None otherwise)
QWEN_WINDOW_FIELDS = dict(
    mapped=("use_sliding_window",),
    ignored={"sliding_window": "a window width, used only with use_sliding_window (refused)",
             "max_window_layers": "where windows start, used only with use_sliding_window (refused)"})


class Qwen2Converter(DenseDecoderConverter):
    family = "qwen2"
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    hf_fields = DenseDecoderConverter.hf_fields.but(**QWEN_WINDOW_FIELDS)

    def config_dict(self, arch: Any, eos_token_id: int = 0) -> dict[str, Any]:
        cfg = super().config_dict(arch, eos_token_id)
        cfg["use_sliding_window"] = False
        return cfg

    def arch_from_config(self, hf: dict[str, Any], where: Path) -> dict[str, Any]:
        if hf.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true is not supported")
        arch = super().arch_from_config(hf, where)
        arch["qkv_bias"] = True
        return arch


SPECS = (FamilySpec("qwen2", "Qwen2", Qwen2Converter, qkv_bias=True, sglang_ties_embeddings=True),)
