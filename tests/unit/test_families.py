"""Model families are specs (megatron_rl/families/): the generic ModelConfig asks the spec of model.family for
every family-dependent switch and check, so a family added as one spec module is validated, defaulted and
listed without a change to ModelConfig."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl import families
from megatron_rl.config.schema import ModelConfig
from megatron_rl.families import FAMILIES, FamilySpec


def test_every_family_has_one_spec_and_its_converter_beside_it():
    from megatron_rl.families import get_converter

    for module in families._MODULES:
        for spec in module.SPECS:
            assert spec.converter.__module__ == module.__name__, f"{spec.name}'s converter is not in its module"
            assert spec.converter.family == spec.name
            assert type(get_converter(spec.name)) is spec.converter


def test_model_config_holds_no_family_tables():
    tables = [k for k in vars(ModelConfig) if k.endswith("_FAMILIES") or k in ("FAMILIES", "GPT_OSS_ONLY")]
    assert tables == []


def test_a_family_added_as_a_spec_is_defaulted_checked_and_listed(monkeypatch):
    seen = []

    def check(m):
        seen.append(m.family)
        if m.num_layers > 8:
            raise ValueError("model.num_layers is invalid: toy has at most 8 layers")

    toy = FamilySpec("toy", "Toy", families.FAMILIES["qwen2"].converter, qkv_bias=True, qk_layernorm=True,
                     partial_rotary=True, check=check)
    monkeypatch.setitem(families.FAMILIES, "toy", toy)
    m = ModelConfig(family="toy", rotary_percent=0.5)
    assert seen == ["toy"] and m.resolved_qkv_bias and m.resolved_qk_layernorm and not m.multi_latent_attention
    with pytest.raises(ValueError, match="toy has at most 8 layers"):
        ModelConfig(family="toy", num_layers=9)
    with pytest.raises(ValueError, match=r"only model\.family=glm4_moe or toy rotates part of each head"):
        ModelConfig(family="qwen2", rotary_percent=0.5)
    with pytest.raises(ValueError, match="allowed values are .*gpt_oss, toy"):
        ModelConfig(family="nope")


def test_the_moe_switches_come_from_the_spec(monkeypatch):
    """A dense spec refuses experts, naming the families that have them; a mixture-of-experts spec requires them."""
    moe = [name for name, spec in FAMILIES.items() if spec.moe]
    with pytest.raises(ValueError, match=f"experts need model.family={' or '.join(moe)}, or"):
        ModelConfig(family="qwen2", num_experts=4, moe_ffn_hidden_size=32)
    monkeypatch.setitem(families.FAMILIES, "qwen2", dataclasses.replace(FAMILIES["qwen2"], moe=True))
    with pytest.raises(ValueError, match="model.family=qwen2 is a mixture of experts"):
        ModelConfig(family="qwen2")
