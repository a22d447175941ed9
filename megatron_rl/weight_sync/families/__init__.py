"""Model-family converters between Hugging Face and Megatron layouts, by family name.

Each family's spec (megatron_rl/families/) names its converter; one file per family here (`llama.py`, `qwen2.py`, `qwen3.py`, `qwen3_moe.py`, `mixtral.py`, `qwen2_moe.py`, `glm4_moe.py`,
`deepseek.py`: DeepSeek-V2 and -V3, `gpt_oss.py`; `yarn.py` holds the YaRN rope parameters both use); each
declares what makes it differ from the dense decoder in `dense.py` (and, for a mixture of experts, uses the MLP layout
of `moe.py`). `get_converter("qwen2")` or `converter_for_model_type(config["model_type"])` pick one;
unknown names raise with the list.
"""

from __future__ import annotations

from megatron_rl.families import FAMILIES, converter_class
from megatron_rl.weight_sync.families.dense import DenseDecoderConverter

# Every family's converter, as its spec names it (the converter modules import none of this, so the package has
# no import circle)
CONVERTERS: tuple[type[DenseDecoderConverter], ...] = tuple(converter_class(spec) for spec in FAMILIES.values())
_MISNAMED = [f"{spec.name}: {cls.__name__} ({cls.family})" for spec, cls in zip(FAMILIES.values(), CONVERTERS)
             if cls.family != spec.name]
if _MISNAMED:
    raise ValueError(f"a family's spec names a converter of another family: {'; '.join(_MISNAMED)}")


def _registry(converters: tuple[type[DenseDecoderConverter], ...]) -> dict[str, DenseDecoderConverter]:
    """family -> converter; a family name, or an HF model_type (or alias), claimed twice is an error."""
    out: dict[str, DenseDecoderConverter] = {}
    owner: dict[str, str] = {}
    for cls in converters:
        if cls.family not in FAMILIES:
            raise ValueError(f"converter {cls.__name__} names family {cls.family!r}, which has no spec (families/)")
        if cls.family in out:
            raise ValueError(f"model family {cls.family!r} is registered twice")
        out[cls.family] = cls()
        for model_type in (cls.model_type, *cls.model_type_aliases):
            if model_type in owner:
                raise ValueError(f"model_type {model_type!r} is claimed by {owner[model_type]!r} and {cls.family!r}")
            owner[model_type] = cls.family
    return out


_REGISTRY = _registry(CONVERTERS)


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
