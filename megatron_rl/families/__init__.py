"""Model families: one module each, holding the family's `FamilySpec`: its architecture switches (mixture of
experts, shared experts, multi-latent attention, router kind and groups, RoPE scalings, biases, attention
sinks), its own config checks, the engine quirks the rollout engines need, and which HF <-> Megatron
converter reads and writes its checkpoints (weight_sync/families/, named by path: the converters need
torch, the specs must not, since config checks run before torch loads).

`ModelConfig` (config/model.py) is generic: it asks the spec of `model.family`. Adding a family is a
module here (listed in `_MODULES`), its converter, a `conf/model/*.yaml` and tests (CONTRIBUTING.md).
"""

from __future__ import annotations

import importlib
from typing import Callable

from megatron_rl.families import deepseek, glm4_moe, gpt_oss, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from megatron_rl.families.spec import FamilySpec

# in this order in messages and listings
_MODULES = (llama, qwen2, qwen3, qwen3_moe, mixtral, qwen2_moe, glm4_moe, deepseek, gpt_oss)


def _collect() -> dict[str, FamilySpec]:
    specs: dict[str, FamilySpec] = {}
    for module in _MODULES:
        for spec in module.SPECS:
            if spec.name in specs:
                raise ValueError(f"model family {spec.name!r} is defined twice ({module.__name__} and before)")
            specs[spec.name] = spec
    return specs


FAMILIES: dict[str, FamilySpec] = _collect()


def family_spec(name: str) -> FamilySpec:
    """The spec of model.family=`name` (a KeyError for an unknown one: the config checks name the valid ones
    before anything asks)."""
    return FAMILIES[name]


def families_where(test: Callable[[FamilySpec], bool]) -> tuple[str, ...]:
    """The families whose spec passes `test`, in the order of `FAMILIES` (for messages)."""
    return tuple(name for name, spec in FAMILIES.items() if test(spec))


def converter_class(spec: FamilySpec) -> type:
    """The family's converter class (imports torch)."""
    module, _, attr = spec.converter.partition(":")
    return getattr(importlib.import_module(f"megatron_rl.weight_sync.families.{module}"), attr)
