"""HF <-> Megatron (full) weight layout for each family, and HF config round trips."""

import json

import pytest
import torch

from megatron_rl.checkpoint.hf import arch_from_hf_config
from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.hf import build_hf_model, hub_state_dict
from megatron_rl.families import family_names, get_converter

FAMILIES = {
    "llama": ModelConfig(family="llama", tie_word_embeddings=False, num_layers=2),
    "qwen2": ModelConfig(family="qwen2", tie_word_embeddings=True, num_layers=2),
    "qwen3": ModelConfig(family="qwen3", tie_word_embeddings=True, num_layers=2, head_dim=48),
    "qwen3_moe": ModelConfig(family="qwen3_moe", tie_word_embeddings=False, num_layers=2, head_dim=48,
                             num_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2),
    "mixtral": ModelConfig(family="mixtral", tie_word_embeddings=False, num_layers=2, ffn_hidden_size=48,
                           num_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2),
    # three different widths (dense 352, experts 48, shared expert 40), so that no two can be confused
    "qwen2_moe": ModelConfig(family="qwen2_moe", tie_word_embeddings=False, num_layers=2, num_experts=4,
                             moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=40, moe_router_topk=2,
                             moe_norm_topk_prob=False),
    # layer 0 dense, layer 1 sparse with two shared experts (96 = 2 x 48), RoPE on half of each head
    "glm4_moe": ModelConfig(family="glm4_moe", tie_word_embeddings=False, num_layers=2, num_experts=4,
                            moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=96, moe_router_topk=2,
                            moe_dense_layers=[0], rotary_percent=0.5, moe_routed_scaling_factor=2.5),
    # multi-latent attention with YaRN, all widths different (q latent 40, kv latent 28, no-RoPE 12, RoPE 6,
    # value 20); layer 0 dense, layer 1 sparse with one shared expert
    "deepseek_v3": ModelConfig(family="deepseek_v3", tie_word_embeddings=False, num_layers=2, num_query_groups=4,
                               num_experts=4, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=48,
                               moe_router_topk=2, moe_dense_layers=[0], moe_routed_scaling_factor=2.5,
                               q_lora_rank=40, kv_lora_rank=28, qk_nope_head_dim=12, qk_rope_head_dim=6,
                               v_head_dim=20, rope_scaling_factor=8.0, max_position_embeddings=512,
                               rope_scaling_original_max_position_embeddings=64, rope_scaling_mscale=1.0,
                               rope_scaling_mscale_all_dim=1.0),
    # DeepSeek-V2: direct queries, 8 experts in 4 groups (3 per token from the 2 best), 2 shared experts
    "deepseek_v2": ModelConfig(family="deepseek_v2", tie_word_embeddings=False, num_layers=2, num_query_groups=4,
                               num_experts=8, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=96,
                               moe_router_topk=3, moe_norm_topk_prob=False, moe_router_num_groups=4,
                               moe_router_group_topk=2, moe_dense_layers=[0], q_lora_rank=None, kv_lora_rank=28,
                               qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=20),
    # gpt-oss: biases, sinks, a sliding window in layer 0, YaRN without truncation; experts stacked on disk
    "gpt_oss": ModelConfig(family="gpt_oss", tie_word_embeddings=False, num_layers=2, ffn_hidden_size=48,
                           num_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2, head_dim=40,
                           rope_scaling_factor=4.0, rope_scaling_original_max_position_embeddings=128,
                           rope_scaling_truncate=False, sliding_window=8, sliding_window_layers=[0], swiglu_limit=7.0),
}
MOE_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe", "mixtral", "qwen2_moe", "qwen3_moe")  # one tensor per expert
HF_MOE_BLOCK = {"qwen3_moe": "mlp.", "mixtral": "block_sparse_moe.", "qwen2_moe": "mlp.",
                "glm4_moe": "mlp.", "deepseek_v3": "mlp.", "deepseek_v2": "mlp."}  # where each keeps it


def test_every_registered_family_is_covered():
    assert family_names() == sorted(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_is_bit_exact(family):
    cfg = FAMILIES[family]
    conv = get_converter(family)
    hf = hub_state_dict(build_hf_model(cfg, seed=0))
    back = conv.megatron_to_hf(conv.hf_to_megatron(hf, cfg), cfg)
    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stage_names_cover_exactly_the_hf_tensors(family):
    cfg = FAMILIES[family]
    conv = get_converter(family)
    hf = hub_state_dict(build_hf_model(cfg, seed=0))
    both = conv.hf_names(cfg, range(cfg.num_layers), True, True)
    expected = set(hf) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert both == expected
    first = conv.hf_names(cfg, [0], True, False)
    assert "model.norm.weight" not in first and not any(".layers.1." in n for n in first)
    shapes = conv.expected_hf_shapes(cfg, both)
    assert {n: tuple(hf[n].shape) for n in both} == shapes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_hf_tensor_can_be_written_in_place(family):
    """What weight sync writes into an engine in place (weight_sync.in_place): each HF tensor the converter
    returns is either a view of one Megatron tensor, or the converter's `in_place_views` (views of Megatron
    tensors, each into a region of it) write exactly it, every element (a NaN left over would show)."""
    cfg = FAMILIES[family]
    conv = get_converter(family)
    meg = {k: v.clone() for k, v in conv.hf_to_megatron(hub_state_dict(build_hf_model(cfg, seed=0)), cfg).items()}
    storages = {v.untyped_storage().data_ptr() for v in meg.values()}
    needed = set()
    for name, tensor in conv.megatron_to_hf(meg, cfg).items():
        if tensor.untyped_storage().data_ptr() in storages:
            continue
        views = conv.in_place_views(name, meg, cfg)
        assert views is not None, f"{name} is no view of a Megatron tensor and has no in_place_views"
        filled = torch.full_like(tensor, float("nan"))
        for shape, index, view in views:
            assert view.untyped_storage().data_ptr() in storages, name
            (filled if shape is None else filled.view(shape))[index].copy_(view)
        assert torch.equal(filled, tensor), name
        needed.add(name.split(".", 3)[-1])
    # Q, K and V of grouped-query attention (linear_qkv interleaves them per KV group), gpt-oss's stacked experts
    kinds = ("weight", "bias") if cfg.resolved_qkv_bias else ("weight",)
    qkv = set() if cfg.multi_latent_attention else {f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in kinds}
    stacked = {f"mlp.experts.{n}" for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    assert needed == qkv | (stacked if family == "gpt_oss" else set())


def test_qkv_rows_are_grouped_per_kv_head():
    cfg = ModelConfig(family="qwen2", num_attention_heads=4, num_query_groups=2, hidden_size=8, num_layers=1,
                      ffn_hidden_size=8, vocab_size=16)
    hf = hub_state_dict(build_hf_model(cfg, seed=0))
    # tag each row with its source: q row i -> 100+i, k row i -> 200+i, v row i -> 300+i
    for name, base in (("q", 100), ("k", 200), ("v", 300)):
        w = hf[f"model.layers.0.self_attn.{name}_proj.weight"]
        w.copy_((base + torch.arange(w.shape[0], dtype=w.dtype))[:, None].expand_as(w))
    meg = get_converter("qwen2").hf_to_megatron(hf, cfg)
    qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist()
    # head_dim 2: group 0 = q heads 0,1 (rows 0..3), k head 0, v head 0; then group 1
    expected = [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    assert cfg.resolved_head_dim == 2 and qkv == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_config_round_trip(tmp_path, family):
    cfg = FAMILIES[family]
    (tmp_path / "config.json").write_text(json.dumps(get_converter(family).config_dict(cfg)))
    arch = arch_from_hf_config(tmp_path)
    resolved = {"qkv_bias": cfg.resolved_qkv_bias, "qk_layernorm": cfg.resolved_qk_layernorm,
                "head_dim": cfg.resolved_head_dim} if not cfg.multi_latent_attention else {}
    for key, value in arch.items():
        assert value == resolved.get(key, getattr(cfg, key, None)), key


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_written_by_transformers_round_trip(tmp_path, family):
    """The config.json that transformers itself writes (5.x renames e.g. num_experts to num_local_experts)."""
    from megatron_rl.models.hf import hf_config

    cfg = FAMILIES[family]
    hf_config(cfg).save_pretrained(tmp_path)
    arch = arch_from_hf_config(tmp_path)
    resolved = {"qkv_bias": cfg.resolved_qkv_bias, "qk_layernorm": cfg.resolved_qk_layernorm,
                "head_dim": cfg.resolved_head_dim} if not cfg.multi_latent_attention else {}
    for key, value in arch.items():
        assert value == resolved.get(key, getattr(cfg, key, None)), key


def test_unsupported_family_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config.json: model_type='gpt2' is not supported"):
        arch_from_hf_config(tmp_path)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    cfg = get_converter("llama").config_dict(FAMILIES["llama"])
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: rope_scaling=.*dynamic.* is not supported"):
        arch_from_hf_config(tmp_path)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_match_transformers_fused_tensors(family):
    """Megatron's expert weights are exactly `transformers`' in-memory (fused) ones: its forward takes
    gate, up = (x @ gate_up_proj[e].T).chunk(2), as Megatron's SwiGLU does with linear_fc1 (for
    Mixtral transformers fuses w1 and w3, and holds `block_sparse_moe` as `mlp`)."""
    cfg = FAMILIES[family]
    model = build_hf_model(cfg, seed=0)
    meg = get_converter(family).hf_to_megatron(hub_state_dict(model), cfg)
    for i, layer in enumerate(model.model.layers):
        if not cfg.is_sparse_layer(i):
            continue
        m = f"decoder.layers.{i}.mlp."
        assert torch.equal(meg[m + "router.weight"], layer.mlp.gate.weight)
        for e in range(cfg.num_experts):
            expert = m + f"experts.local_experts.{e}."
            assert torch.equal(meg[expert + "linear_fc1.weight"], layer.mlp.experts.gate_up_proj[e])
            assert torch.equal(meg[expert + "linear_fc2.weight"], layer.mlp.experts.down_proj[e])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_an_expert_parallel_rank_reads_only_its_experts(family):
    cfg = FAMILIES[family]
    conv = get_converter(family)
    block = "." + HF_MOE_BLOCK[family]
    names = conv.hf_names(cfg, [1], False, True, experts=range(2, 4))
    experts = {n.split(block + "experts.")[1].split(".")[0] for n in names if block + "experts." in n}
    assert experts == {"2", "3"} and f"model.layers.1{block}gate.weight" in names
    assert len([n for n in names if block + "experts." in n]) == 2 * 3  # gate, up, down of each
    hf = hub_state_dict(build_hf_model(cfg, seed=0))
    meg = conv.hf_to_megatron({n: hf[n] for n in names}, cfg)
    assert {n for n in meg if ".local_experts." in n} == {
        f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in (2, 3) for k in (1, 2)}
    back = conv.megatron_to_hf(meg, cfg)
    assert {n for n in back if block in n} == {n for n in names if block in n}


@pytest.mark.parametrize(("key", "value"), [("shared_expert_intermediate_size", 64), ("num_experts", 0),
                                            ("decoder_sparse_step", 0), ("mlp_only_layers", [4]),
                                            ("mlp_only_layers", [0, 1, 2, 3])])
def test_unsupported_moe_layouts_are_refused_naming_the_file(tmp_path, key, value):
    cfg = get_converter("qwen3_moe").config_dict(ModelConfig(**{**vars(FAMILIES["qwen3_moe"]), "num_layers": 4}))
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config.json: {key}="):
        arch_from_hf_config(tmp_path)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize(("mlp_only_layers", "decoder_sparse_step"), [([1], 1), ([], 2), ([3], 2), ([0, 4], 3)])
def test_dense_layers_are_those_transformers_builds_dense(tmp_path, family, mlp_only_layers, decoder_sparse_step):
    """`moe_dense_layers` from a config.json's mlp_only_layers and decoder_sparse_step is the set of
    layers that transformers itself builds without experts; the config written back builds the
    same model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = get_converter(family).config_dict(ModelConfig(**{**vars(FAMILIES[family]), "num_layers": 6}))
    cfg.update(mlp_only_layers=mlp_only_layers, decoder_sparse_step=decoder_sparse_step)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    built_dense = [i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "experts")]
    arch = arch_from_hf_config(tmp_path)
    assert arch["moe_dense_layers"] == built_dense and 0 < len(built_dense) < 6
    written = get_converter(family).config_dict(ModelConfig(**arch))
    assert (written["mlp_only_layers"], written["decoder_sparse_step"]) == (built_dense, 1)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_a_dense_layer_among_experts_keeps_the_dense_layout(family):
    """Layer 1 of 3 dense: its MLP converts as a dense model's (no router, experts or shared expert,
    width ffn_hidden_size), every expert-parallel rank reads it whole, and the round trip is exact."""
    cfg = ModelConfig(**{**vars(FAMILIES[family]), "num_layers": 3, "moe_dense_layers": [1]})
    conv = get_converter(family)
    model = build_hf_model(cfg, seed=0)
    hf = hub_state_dict(model)
    dense_mlp = {f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert {n for n in hf if n.startswith("model.layers.1.mlp.")} == dense_mlp
    for experts in (range(0, 2), range(2, 4)):
        names = conv.hf_names(cfg, [1], False, False, experts=experts)
        assert {n for n in names if ".mlp." in n} == dense_mlp
    meg = conv.hf_to_megatron(hf, cfg)
    assert {n for n in meg if n.startswith("decoder.layers.1.mlp.")} == {
        "decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc2.weight"}
    mlp = model.model.layers[1].mlp
    assert torch.equal(meg["decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([mlp.gate_proj.weight,
                                                                                mlp.up_proj.weight]))
    assert meg["decoder.layers.1.mlp.linear_fc2.weight"].shape == (cfg.hidden_size, cfg.ffn_hidden_size)
    assert any(n.startswith("decoder.layers.2.mlp.router.") for n in meg)  # its neighbours keep experts
    back = conv.megatron_to_hf(meg, cfg)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], v) for k, v in hf.items())
    assert conv.expected_hf_shapes(cfg, hf) == {n: tuple(t.shape) for n, t in hf.items()}
    assert all(conv.hf_memory_slot(n, cfg) == (n, ()) for n in dense_mlp)


def test_shared_expert_matches_transformers_modules():
    """Megatron's shared expert is `transformers`' `mlp.shared_expert` ([gate; up] fused like a dense
    SwiGLU) and its gate_weight the [1, H] weight of `mlp.shared_expert_gate`."""
    cfg = FAMILIES["qwen2_moe"]
    model = build_hf_model(cfg, seed=0)
    meg = get_converter("qwen2_moe").hf_to_megatron(hub_state_dict(model), cfg)
    for i, layer in enumerate(model.model.layers):
        m = f"decoder.layers.{i}.mlp.shared_experts."
        shared = layer.mlp.shared_expert
        assert torch.equal(meg[m + "linear_fc1.weight"], torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        assert torch.equal(meg[m + "linear_fc2.weight"], shared.down_proj.weight)
        assert torch.equal(meg[m + "gate_weight"], layer.mlp.shared_expert_gate.weight)
        assert meg[m + "linear_fc1.weight"].shape == (2 * 40, cfg.hidden_size)


def test_every_expert_parallel_rank_reads_the_shared_expert():
    cfg = FAMILIES["qwen2_moe"]
    shared = {"model.layers.1.mlp.shared_expert_gate.weight"} | {
        f"model.layers.1.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}
    for experts in (range(0, 2), range(2, 4)):
        assert shared <= get_converter("qwen2_moe").hf_names(cfg, [1], False, True, experts=experts)


@pytest.mark.parametrize(("key", "value"), [("shared_expert_intermediate_size", 0), ("num_experts", 0),
                                            ("qkv_bias", False), ("use_sliding_window", True)])
def test_unsupported_qwen2_moe_configs_are_refused_naming_the_file(tmp_path, key, value):
    cfg = get_converter("qwen2_moe").config_dict(FAMILIES["qwen2_moe"])
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config.json: {key}="):
        arch_from_hf_config(tmp_path)


def test_qwen2_moe_config_in_the_transformers_4_spelling(tmp_path):
    """Qwen1.5-MoE's config.json as transformers 4 wrote it: rope_theta at the top level, no qkv_bias
    key (the bias was unconditional), norm_topk_prob false; every layer sparse with a shared expert."""
    written = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_act": "silu",
               "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4, "vocab_size": 96, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
               "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_sliding_window": False,
               "sliding_window": 32768, "decoder_sparse_step": 1, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 176, "num_experts_per_tok": 4, "num_experts": 6,
               "norm_topk_prob": False, "router_aux_loss_coef": 0.001}
    (tmp_path / "config.json").write_text(json.dumps(written))
    arch = arch_from_hf_config(tmp_path)
    assert (arch["family"], arch["num_experts"], arch["moe_router_topk"]) == ("qwen2_moe", 6, 4)
    assert (arch["ffn_hidden_size"], arch["moe_ffn_hidden_size"], arch["moe_shared_expert_intermediate_size"]) == (
        176, 32, 176)
    assert arch["qkv_bias"] is True and arch["qk_layernorm"] is False and arch["moe_norm_topk_prob"] is False
    assert arch["rope_theta"] == 1000000.0
    ModelConfig(**arch)  # a valid architecture


@pytest.mark.parametrize(("key", "value"), [("sliding_window", 4096), ("router_jitter_noise", 0.01),
                                            ("num_local_experts", 0)])
def test_unsupported_mixtral_configs_are_refused_naming_the_file(tmp_path, key, value):
    cfg = get_converter("mixtral").config_dict(FAMILIES["mixtral"])
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config.json: {key}="):
        arch_from_hf_config(tmp_path)


def test_mixtral_config_maps_intermediate_size_to_the_expert_width(tmp_path):
    """Mixtral's config.json has one width, the experts': it becomes moe_ffn_hidden_size (and
    ffn_hidden_size, which has no dense MLP to size), and routing is always renormalised."""
    from transformers import MixtralConfig

    MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2).save_pretrained(tmp_path)
    arch = arch_from_hf_config(tmp_path)
    assert (arch["family"], arch["num_experts"], arch["moe_router_topk"]) == ("mixtral", 3, 2)
    assert arch["moe_ffn_hidden_size"] == arch["ffn_hidden_size"] == 24
    assert arch["moe_norm_topk_prob"] is True and arch["qkv_bias"] is False and arch["qk_layernorm"] is False
    ModelConfig(**arch)  # a valid architecture


LLAMA_3_1 = ModelConfig(family="llama", tie_word_embeddings=False, num_layers=2, rope_theta=500000.0,
                        rope_scaling_factor=8.0, max_position_embeddings=16384)
ROPE_FIELDS = ("rope_theta", "rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
               "rope_scaling_original_max_position_embeddings")


@pytest.mark.parametrize("writer", ["config_dict", "transformers"])
def test_llama3_rope_scaling_round_trips(tmp_path, writer):
    """Ours (rope_scaling, the pre-5.0 spelling) and what transformers 5 writes from it (rope_parameters)."""
    from megatron_rl.models.hf import hf_config

    if writer == "config_dict":
        (tmp_path / "config.json").write_text(json.dumps(get_converter("llama").config_dict(LLAMA_3_1)))
    else:
        hf_config(LLAMA_3_1).save_pretrained(tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())
        assert saved["rope_parameters"]["rope_type"] == "llama3" and saved["rope_parameters"]["factor"] == 8.0
    arch = arch_from_hf_config(tmp_path)
    assert {k: arch[k] for k in ROPE_FIELDS} == {k: getattr(LLAMA_3_1, k) for k in ROPE_FIELDS}
    assert arch["rope_scaling_factor"] == 8.0  # not the default


def test_llama_3_1_config_json_as_published(tmp_path):
    """The rope entries of meta-llama/Llama-3.1-8B's config.json (written by transformers 4.43)."""
    cfg = get_converter("llama").config_dict(FAMILIES["llama"])
    cfg.update(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = arch_from_hf_config(tmp_path)
    assert (arch["rope_theta"], arch["rope_scaling_factor"]) == (500000.0, 8.0)
    ModelConfig(**arch)  # Megatron-core can build it


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_qwen_long_context_yarn_as_the_model_cards_give_it(tmp_path, family):
    """The entry Qwen's model cards tell users to add to config.json for long inputs (the old `type` key,
    transformers' defaults for the rest) reads as YaRN, validates, and is written back the same way."""
    cfg = get_converter(family).config_dict(FAMILIES[family])
    cfg.update(max_position_embeddings=32768, rope_scaling={"type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 32768})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = ModelConfig(**arch_from_hf_config(tmp_path))
    assert (arch.rope_scaling_type, arch.yarn, arch.rope_scaling_factor) == ("yarn", True, 4.0)
    assert (arch.rope_scaling_original_max_position_embeddings, arch.rope_scaling_beta_fast,
            arch.rope_scaling_beta_slow, arch.rope_scaling_mscale, arch.rope_scaling_mscale_all_dim) == (
        32768, 32.0, 1.0, 1.0, 0.0)
    written = get_converter(family).config_dict(arch)["rope_scaling"]
    assert written == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                       "beta_fast": 32.0, "beta_slow": 1.0}


def test_yarn_without_factor_or_original_context_reads_as_transformers_defaults(tmp_path):
    """transformers: the original context defaults to max_position_embeddings (or a top-level
    original_max_position_embeddings), the factor to the ratio of the two."""
    cfg = get_converter("qwen2").config_dict(FAMILIES["qwen2"])
    cfg.update(max_position_embeddings=8192, original_max_position_embeddings=2048,
               rope_scaling={"rope_type": "yarn"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = arch_from_hf_config(tmp_path)
    assert (arch["rope_scaling_factor"], arch["rope_scaling_original_max_position_embeddings"]) == (4.0, 2048)
    del cfg["original_max_position_embeddings"]
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = arch_from_hf_config(tmp_path)
    assert (arch["rope_scaling_factor"], arch["rope_scaling_original_max_position_embeddings"]) == (2.0, 8192)


def test_a_checkpoint_without_yarn_resets_a_config_files_yarn(tmp_path):
    """model.rope_scaling_type=yarn (and its fields) from the command line do not survive a checkpoint whose
    config.json has Llama 3.1 scaling or none: the checkpoint's architecture wins, every rope field of it."""
    from megatron_rl.runtime import load_validated

    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(get_converter("llama").config_dict(LLAMA_3_1)))
    # config validation wants the weights config.json describes, each of them
    save_file(hub_state_dict(build_hf_model(LLAMA_3_1, seed=0)), str(tmp_path / "model.safetensors"))
    yarn = ["model.rope_scaling_type=yarn", "model.rope_scaling_factor=4", "model.rope_scaling_beta_fast=16"]
    model = load_validated(["model=tiny_llama", f"model.path={tmp_path}", *yarn], world_size=1).model
    assert (model.rope_scaling_type, model.yarn, model.rope_scaling_factor, model.rope_scaling_beta_fast) == (
        None, False, 8.0, 32.0)


def test_rope_scaling_megatron_cannot_apply_is_refused_naming_file_and_field(tmp_path):
    from megatron_rl.config import ConfigError
    from megatron_rl.runtime import load_validated

    cfg = get_converter("llama").config_dict(LLAMA_3_1)
    cfg["rope_scaling"]["original_max_position_embeddings"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json: model.rope_scaling_original_max_position_embeddings=4096 "
                                          r"is invalid: .*only 8192 is supported"):
        load_validated(["model=tiny_llama", f"model.path={tmp_path}"], world_size=1)


def test_mla_tensors_map_one_to_one():
    """Multi-latent attention: each HF projection is one Megatron tensor, unchanged (both order a head's
    query rows [no-RoPE; RoPE] and its key-value rows [key; value]); without query compression the
    query projection is direct."""
    cfg = FAMILIES["deepseek_v3"]
    conv = get_converter("deepseek_v3")
    hf = hub_state_dict(build_hf_model(cfg, seed=0))
    meg = conv.hf_to_megatron(hf, cfg)
    att, m = "model.layers.1.self_attn.", "decoder.layers.1.self_attention."
    pairs = {"q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm", "q_b_proj": "linear_q_up_proj",
             "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_a_layernorm": "kv_layernorm",
             "kv_b_proj": "linear_kv_up_proj", "o_proj": "linear_proj"}
    for hf_name, meg_name in pairs.items():
        assert torch.equal(meg[m + meg_name + ".weight"], hf[att + hf_name + ".weight"]), hf_name
    assert meg[m + "linear_kv_down_proj.weight"].shape == (28 + 6, cfg.hidden_size)
    assert meg[m + "linear_kv_up_proj.weight"].shape == (4 * (12 + 20), 28)
    direct = ModelConfig(**{**vars(cfg), "q_lora_rank": None})
    names = conv.hf_names(direct, [1], False, False)
    assert att + "q_proj.weight" in names and not any("q_a_" in n or "q_b_" in n for n in names)
    assert conv.expected_hf_shapes(direct, [att + "q_proj.weight"]) == {att + "q_proj.weight": (4 * 18, 128)}


def test_kimi_k2_style_config_loads_as_deepseek_v3(tmp_path):
    """Kimi-K2's config.json names model_type kimi_k2 (its remote code) and YaRN with beta_fast = beta_slow = 1,
    one expert group; it reads as the deepseek_v3 family, whose export writes model_type deepseek_v3."""
    cfg = get_converter("deepseek_v3").config_dict(FAMILIES["deepseek_v3"])
    cfg.update(model_type="kimi_k2", n_group=1, topk_group=1)
    cfg["rope_parameters"].update(beta_fast=1.0, beta_slow=1.0)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = ModelConfig(**arch_from_hf_config(tmp_path))  # validates
    assert (arch.family, arch.rope_scaling_beta_fast, arch.rope_scaling_beta_slow) == ("deepseek_v3", 1.0, 1.0)
    assert get_converter("deepseek_v3").config_dict(arch)["model_type"] == "deepseek_v3"


def test_deepseek_v3_without_yarn_resets_every_rope_field(tmp_path):
    """A checkpoint without YaRN gives every rope field its no-YaRN value, so that a config file's YaRN
    settings (model=deepseek_v3 with another checkpoint's path) cannot survive beside it."""
    cfg = get_converter("deepseek_v3").config_dict(ModelConfig(**{**vars(FAMILIES["deepseek_v3"]),
                                                                  "rope_scaling_factor": None,
                                                                  "rope_scaling_mscale_all_dim": 0.0}))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = arch_from_hf_config(tmp_path)
    assert (arch["rope_scaling_factor"], arch["rope_scaling_mscale_all_dim"], arch["rope_scaling_mscale"],
            arch["rope_scaling_original_max_position_embeddings"]) == (None, 0.0, 1.0, 8192)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_keys_a_config_leaves_out_mean_what_transformers_reads(tmp_path, family):
    """A config.json without the RoPE base, the norms' epsilon or the context length: each family's values are
    the ones transformers builds that checkpoint's model with (Mixtral's theta 1e6 and eps 1e-5, Llama's 2048
    positions), not ModelConfig's defaults."""
    from transformers import AutoConfig

    cfg = get_converter(family).config_dict(FAMILIES[family])
    for key in ("rope_theta", "rms_norm_eps", "max_position_embeddings"):
        cfg.pop(key, None)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), dict):
            cfg[key].pop("rope_theta", None)
            if cfg[key].get("rope_type", cfg[key].get("type")) in ("default", None) and len(cfg[key]) <= 1:
                del cfg[key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = arch_from_hf_config(tmp_path)
    ref = AutoConfig.from_pretrained(tmp_path)
    assert arch["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert arch["norm_eps"] == ref.rms_norm_eps and arch["max_position_embeddings"] == ref.max_position_embeddings


def test_deepseek_v3_defaults_are_transformers_defaults(tmp_path):
    """Keys absent from config.json mean what transformers' DeepseekV3Config defaults to."""
    from transformers import DeepseekV3Config

    cfg = get_converter("deepseek_v3").config_dict(FAMILIES["deepseek_v3"])
    for key in ("q_lora_rank", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"):
        del cfg[key]
    cfg["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = arch_from_hf_config(tmp_path)
    ref = DeepseekV3Config()
    assert (arch["q_lora_rank"], arch["moe_router_num_groups"], arch["moe_router_group_topk"],
            arch["moe_routed_scaling_factor"], len(arch["moe_dense_layers"])) == (
        ref.q_lora_rank, ref.n_group, ref.topk_group, ref.routed_scaling_factor, ref.first_k_dense_replace)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("rope_interleave", False, "rope_interleave=false"), ("attention_bias", True, "attention_bias=true"),
    ("scoring_func", "softmax", "scoring_func='softmax'"), ("n_shared_experts", 0, "shared experts"),
    ("first_k_dense_replace", 2, "leaves no layer with experts"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "only default RoPE and YaRN"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False},
     "truncate=false"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                      "attention_factor": 1.5}, "attention_factor=1.5 differs from the 1.20794")])
def test_unsupported_deepseek_v3_configs_are_refused_naming_the_file(tmp_path, key, value, message):
    cfg = get_converter("deepseek_v3").config_dict(FAMILIES["deepseek_v3"])
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json") as info:
        arch_from_hf_config(tmp_path)
    assert message in str(info.value)


def test_deepseek_v3_config_json_as_published(tmp_path):
    """DeepSeek-V3's config.json as released (transformers 4 spelling: rope_scaling with "type", the
    attributes of its remote code); the architecture read from it is conf/model/deepseek_v3.yaml's."""
    from megatron_rl.config import load_config

    published = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_shared_experts": 1, "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False, "attention_bias": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"}}
    (tmp_path / "config.json").write_text(json.dumps(published))
    arch = arch_from_hf_config(tmp_path)
    shipped = load_config(["model=deepseek_v3", "model.path=null", "model.tokenizer=builtin:char",
                           "parallel.tp=8", "parallel.sequence_parallel=true"], world_size=8).model
    for key, value in arch.items():
        assert value == getattr(shipped, key), key


def test_a_quantized_checkpoint_is_refused_naming_the_file(tmp_path):
    """DeepSeek-V3 is released in fp8 with per-block scales (`weight_scale_inv`): a cast without them
    would load wrong weights, so the config is refused before any tensor is read."""
    cfg = get_converter("deepseek_v3").config_dict(FAMILIES["deepseek_v3"])
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: quantization_config \(quant_method='fp8'\)"):
        arch_from_hf_config(tmp_path)


@pytest.mark.parametrize(("method", "groups"), [("greedy", 1), ("group_limited_greedy", 4)])
def test_deepseek_v2_router_reads_back(tmp_path, method, groups):
    """DeepSeek-V2's topk_method: greedy ignores the groups (transformers does), group_limited_greedy keeps
    them."""
    cfg = get_converter("deepseek_v2").config_dict(FAMILIES["deepseek_v2"])
    assert cfg["topk_method"] == "group_limited_greedy" and cfg["scoring_func"] == "softmax"
    cfg.update(topk_method=method)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = ModelConfig(**arch_from_hf_config(tmp_path))
    assert (arch.moe_router_num_groups, arch.moe_norm_topk_prob) == (groups, False)


@pytest.mark.parametrize(("change", "message"), [
    (dict(topk_method="noaux_tc", scoring_func="sigmoid"), "use model_type deepseek_v3"),
    (dict(norm_topk_prob=True), "norm_topk_prob=true is not supported")])
def test_deepseek_v2_refuses_routing_it_cannot_follow(tmp_path, change, message):
    """DeepSeek-V3's router under the V2 model type; renormalised weights, which transformers' DeepseekV2
    ignores but DeepSeek's code and SGLang apply (the trainer and the engine would route differently)."""
    cfg = get_converter("deepseek_v2").config_dict(FAMILIES["deepseek_v2"])
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(tmp_path)


def test_gpt_oss_experts_compute_what_transformers_computes():
    """Megatron's expert = transformers' GptOssExperts on the same input: fc1 rows [gate; up] from the
    interleaved gate_up_proj columns, the clamped SwiGLU as Megatron-core computes it (quick_gelu(min(gate, 7))
    x (clamp(up, -7, 7) + 1)), and fc2 from the transposed down_proj, biases included."""
    cfg = FAMILIES["gpt_oss"]
    model = build_hf_model(cfg, seed=0)
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():  # large enough that the clamp bites
        experts.gate_up_proj.mul_(200.0)
        bias = torch.randn(experts.gate_up_proj_bias.shape, generator=torch.Generator().manual_seed(1))
        experts.gate_up_proj_bias.copy_(bias)
    meg = get_converter("gpt_oss").hf_to_megatron(hub_state_dict(model), cfg)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    for e in range(cfg.num_experts):
        with torch.no_grad():
            hidden = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
            assert hidden.abs().max() > 7.0
            want = experts._apply_gate(hidden) @ experts.down_proj[e] + experts.down_proj_bias[e]
        m = f"decoder.layers.1.mlp.experts.local_experts.{e}."
        gate, up = (x @ meg[m + "linear_fc1.weight"].t() + meg[m + "linear_fc1.bias"]).chunk(2, dim=-1)
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        activated = gate * torch.sigmoid(1.702 * gate) * (up + 1)
        got = activated @ meg[m + "linear_fc2.weight"].t() + meg[m + "linear_fc2.bias"]
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_gpt_oss_stacked_experts_are_read_by_rows():
    """The stacked expert tensors are one name per layer: an expert-parallel rank names all of them and reads
    its rows; Megatron names experts by their global index from `first_expert`; writing back needs them all."""
    cfg = FAMILIES["gpt_oss"]
    conv = get_converter("gpt_oss")
    names = conv.hf_names(cfg, [1], False, True, experts=range(2, 4))
    stacked = conv.stacked_expert_names(names)
    endings = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    assert stacked == {f"model.layers.1.mlp.experts.{n}" for n in endings}
    hf = hub_state_dict(build_hf_model(cfg, seed=0))
    rows = {n: (hf[n][2:4] if n in stacked else hf[n]) for n in names}
    meg = conv.hf_to_megatron(rows, cfg, first_expert=2)
    full = conv.hf_to_megatron(hf, cfg)
    experts = {n for n in meg if ".local_experts." in n}
    assert experts == {f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc{k}.{p}"
                       for e in (2, 3) for k in (1, 2) for p in ("weight", "bias")}
    for name in experts:
        assert torch.equal(meg[name], full[name]), name
    with pytest.raises(ValueError, match="needs all 4 of them; got 2"):
        conv.megatron_to_hf(meg, cfg)


@pytest.mark.parametrize("size", ["20b", "120b"])
def test_gpt_oss_config_json_as_published(tmp_path, size):
    """gpt-oss's config.json as released (transformers 4 spelling, rope_scaling; quantization_config dropped, as
    in a bf16 copy); the architecture read from it is conf/model/gpt_oss_{size}.yaml's."""
    from megatron_rl.config import load_config

    layers, experts = {"20b": (24, 32), "120b": (36, 128)}[size]
    published = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2), "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": layers,
        "num_key_value_heads": 8, "num_local_experts": experts, "output_router_logits": False,
        "pad_token_id": 199999, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}
    (tmp_path / "config.json").write_text(json.dumps(published))
    arch = arch_from_hf_config(tmp_path)
    shipped = load_config([f"model=gpt_oss_{size}", "model.path=null", "model.tokenizer=builtin:char",
                           "parallel.tp=8", "parallel.sequence_parallel=true"], world_size=8).model
    for key, value in arch.items():
        assert value == getattr(shipped, key), key
    published["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(published))
    with pytest.raises(ValueError, match=r"config.json: quantization_config \(quant_method='mxfp4'\)"):
        arch_from_hf_config(tmp_path)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("attention_bias", False, "attention_bias=false"), ("swiglu_alpha", 1.5, "swiglu_alpha=1.5"),
    ("layer_types", ["sliding_attention", "chunked_attention"], "layer_types="),
    ("layer_types", ["sliding_attention"], "layer_types="), ("num_local_experts", 0, "needs experts"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "only default RoPE and YaRN"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "attention_factor": 1.5}, "attention_factor=1.5 differs")])
def test_unsupported_gpt_oss_configs_are_refused_naming_the_file(tmp_path, key, value, message):
    cfg = get_converter("gpt_oss").config_dict(FAMILIES["gpt_oss"])
    cfg.pop("rope_parameters")
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json: ") as info:
        arch_from_hf_config(tmp_path)
    assert message in str(info.value)


def test_gpt_oss_config_without_rope_keys_reads_as_transformers_defaults(tmp_path):
    """No rope_scaling / rope_parameters / rope_theta: transformers' GptOssConfig gives YaRN (factor 32 over 4096,
    truncate false) and theta 150000, not plain RoPE at 10000."""
    from transformers import GptOssConfig

    cfg = get_converter("gpt_oss").config_dict(FAMILIES["gpt_oss"])
    cfg.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = arch_from_hf_config(tmp_path)
    ref = GptOssConfig().rope_parameters
    assert (arch["rope_theta"], arch["rope_scaling_factor"], arch["rope_scaling_truncate"],
            arch["rope_scaling_original_max_position_embeddings"], arch["rope_scaling_beta_fast"]) == (
        ref["rope_theta"], ref["factor"], ref["truncate"], ref["original_max_position_embeddings"], ref["beta_fast"])


@pytest.mark.parametrize(("te", "cudnn", "head_dim", "problem"), [
    ("2.11.0", 91800, 64, "Transformer Engine 2.11.0"), ("2.12.0", 91700, 64, "cuDNN 91700"),
    ("2.12.0", 91800, 64, None), ("2.12.0rc1", 91800, 64, None), ("2.13.0.dev0+abc", 92600, 32, None),
    ("2.12.0", 92500, 32, "heads 32 wide")])
def test_transformer_engine_versions_for_attention_sinks(te, cudnn, head_dim, problem):
    """gpt-oss on the TE spec needs a TE and cuDNN that run sinks over packed rows; older ones are named."""
    from megatron_rl.models.gpt import te_sink_attention_problem

    got = te_sink_attention_problem(te, cudnn, head_dim)
    assert (got is None) if problem is None else (problem in got)
