"""Model-family converters between Hugging Face and Megatron layouts, registered by name.

One file per family (`llama.py`, `qwen2.py`, `qwen3.py`, `qwen3_moe.py`, `mixtral.py`, `qwen2_moe.py`, `glm4_moe.py`,
`deepseek.py`: DeepSeek-V2 and -V3, `gpt_oss.py`; `yarn.py` holds the YaRN rope parameters both use); each
declares what makes it differ from the dense decoder in `dense.py` (and, for a mixture of experts, uses the MLP layout
of `moe.py`). `get_converter("qwen2")` or `converter_for_model_type(config["model_type"])` pick one;
unknown names raise with the list.
"""

from __future__ import annotations

from megatron_rl.weight_sync.families.dense import DenseDecoderConverter

_REGISTRY: dict[str, DenseDecoderConverter] = {}


def register(cls: type[DenseDecoderConverter]) -> type[DenseDecoderConverter]:
    if cls.family in _REGISTRY:
        raise ValueError(f"model family {cls.family!r} is registered twice")
    _REGISTRY[cls.family] = cls()
    return cls


def families() -> list[str]:
    return sorted(_REGISTRY)


def get_converter(family: str) -> DenseDecoderConverter:
    if family not in _REGISTRY:
        raise ValueError(f"model.family={family!r} has no converter; supported: {', '.join(families())}")
    return _REGISTRY[family]


def converter_for_model_type(model_type: str) -> DenseDecoderConverter:
    for conv in _REGISTRY.values():
        if model_type in (conv.model_type, *conv.model_type_aliases):
            return conv
    supported = ", ".join(sorted(t for c in _REGISTRY.values() for t in (c.model_type, *c.model_type_aliases)))
    raise ValueError(f"model_type={model_type!r} is not supported; supported: {supported}")


from megatron_rl.weight_sync.families import (  # noqa: E402,F401  (registration)
    deepseek, glm4_moe, gpt_oss, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe)
