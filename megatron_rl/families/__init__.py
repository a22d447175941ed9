"""Model families: one module each, holding everything the project knows of the family.

A family module holds its `FamilySpec` (architecture switches: mixture of experts, shared experts, multi-latent
attention, router kind and groups, RoPE scalings, biases, attention sinks; its own config checks; the engine
quirks the rollout engines need) and its HF <-> Megatron converter: the HF config fields it reads, refuses or
ignores, and the tensor mapping. The converters share the dense decoder and MoE layouts of `convert/`. Nothing
here imports torch at module level (the conversions import it when they run), so the config checks, which run
before torch loads, read the same module.

`ModelConfig` (config/model.py) is generic: it asks the spec of `model.family`. Adding a family is a module here
(listed in `_MODULES`), a `conf/model/*.yaml` and tests (CONTRIBUTING.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from megatron_rl.families import deepseek, glm4_moe, gpt_oss, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from megatron_rl.families.spec import FamilySpec

if TYPE_CHECKING:
    from megatron_rl.families.convert.dense import DenseDecoderConverter

# in this order in messages and listings
_MODULES = (llama, qwen2, qwen3, qwen3_moe, mixtral, qwen2_moe, glm4_moe, deepseek, gpt_oss)


def _collect() -> dict[str, FamilySpec]:
    specs: dict[str, FamilySpec] = {}
    for module in _MODULES:
        for spec in module.SPECS:
            if spec.name in specs:
                raise ValueError(f"model family {spec.name!r} is defined twice ({module.__name__} and before)")
            if spec.converter.family != spec.name:
                raise ValueError(f"family {spec.name!r}'s spec names {spec.converter.__name__}, the converter of "
                                 f"{spec.converter.family!r}")
            specs[spec.name] = spec
    return specs


FAMILIES: dict[str, FamilySpec] = _collect()


def _converters() -> dict[str, DenseDecoderConverter]:
    """family -> converter instance; an HF model_type (or alias) claimed by two families is an error."""
    owner: dict[str, str] = {}
    for spec in FAMILIES.values():
        for model_type in (spec.converter.model_type, *spec.converter.model_type_aliases):
            if model_type in owner:
                raise ValueError(f"model_type {model_type!r} is claimed by {owner[model_type]!r} and {spec.name!r}")
            owner[model_type] = spec.name
    return {name: spec.converter() for name, spec in FAMILIES.items()}


_CONVERTERS = _converters()


def family_spec(name: str) -> FamilySpec:
    """The spec of model.family=`name` (a KeyError for an unknown one: the config checks name the valid ones
    before anything asks)."""
    return FAMILIES[name]


def families_where(test: Callable[[FamilySpec], bool]) -> tuple[str, ...]:
    """The families whose spec passes `test`, in the order of `FAMILIES` (for messages)."""
    return tuple(name for name, spec in FAMILIES.items() if test(spec))


def family_names() -> list[str]:
    return sorted(FAMILIES)


def get_converter(family: str) -> DenseDecoderConverter:
    if family not in _CONVERTERS:
        raise ValueError(f"model.family={family!r} has no converter; supported: {', '.join(family_names())}")
    return _CONVERTERS[family]


def converter_for_model_type(model_type: str) -> DenseDecoderConverter:
    for conv in _CONVERTERS.values():
        if model_type in (conv.model_type, *conv.model_type_aliases):
            return conv
    supported = ", ".join(sorted(t for c in _CONVERTERS.values() for t in (c.model_type, *c.model_type_aliases)))
    raise ValueError(f"model_type={model_type!r} is not supported; supported: {supported}")
