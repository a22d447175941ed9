"""Parameter names the converters see: the local layer spec's, whichever spec built the model.

The Transformer Engine spec (GPU) fuses each layer's input norm into `linear_qkv` and a dense
MLP's norm into `linear_fc1` (TELayerNormColumnParallelLinear's `layer_norm_weight`); loading an
HF checkpoint into such a model and syncing its weights both go through `canonical_name`. The
GPU tier (tests/gpu/test_packed_attention_gpu.py) loads a full state dict into a TE model.
"""

import pytest

from megatron_rl.models.hf import build_hf_model, hub_state_dict
from megatron_rl.families import get_converter
from megatron_rl.weight_sync.sharding import canonical_name
from tests.unit.test_hf_layout import FAMILIES


def test_fused_norms_get_their_local_names():
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    # multi-latent attention: the latent norms fuse into the up projections, the input norm stays apart
    assert canonical_name("decoder.layers.2.self_attention.linear_q_up_proj.layer_norm_weight") == \
        "decoder.layers.2.self_attention.q_layernorm.weight"
    assert canonical_name("decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight") == \
        "decoder.layers.2.self_attention.kv_layernorm.weight"
    assert canonical_name("decoder.layers.2.self_attention.linear_kv_up_proj.weight") == \
        "decoder.layers.2.self_attention.linear_kv_up_proj.weight"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_local_spec_names_are_left_alone(family):
    cfg = FAMILIES[family]
    names = get_converter(family).hf_to_megatron(hub_state_dict(build_hf_model(cfg, seed=0)), cfg)
    assert any(n.endswith("input_layernorm.weight") for n in names)
    assert all(canonical_name(n) == n for n in names)
