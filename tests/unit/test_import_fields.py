"""Importers account for everything: every config.json key and every checkpoint tensor of every family is
mapped, ignored by name for a stated reason, or refused naming it.

Table-driven: each entry of FLIPS changes one config.json key (a bias, a window, a RoPE variant, a norm epsilon,
soft-capping, ...) on each family's tiny config. The import then either refuses it, naming the key, or accepts
it; an accepted flip is a checkpoint transformers builds from that config (random weights, the biases and norms
random too, so that none is a no-op), and
- every tensor of it is one the import reads, and the HF -> Megatron -> HF conversion gives it back bit-exactly;
- if the architecture read is the unflipped one, the key is on the family's ignored list (or unknown to it
  and off: 0, false, null), and transformers computes the same logits with the key as without it (the ignore
  is harmless);
- otherwise the key changed the architecture, and tests/distributed/test_import_fields.py checks that
  Megatron computes transformers' log-probs from that checkpoint (<= 1e-4), that the export loads back
  bit-exactly and that weight sync fills the hf engine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from megatron_rl.checkpoint.hf import arch_from_hf_config, check_tensor_names
from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.hf import hf_config, hub_state_dict
from megatron_rl.families import family_names, get_converter
from megatron_rl.families.convert.fields import ROPE_KEYS
from tests.unit.test_hf_layout import FAMILIES

Flip = Callable[[dict[str, Any], ModelConfig], dict[str, Any]]
TOL = 1e-6  # transformers against itself, same weights and kernels


def _set(**values: Any) -> Flip:
    return lambda hf, cfg: {**hf, **values}


def _toggle(key: str, default: bool = False) -> Flip:
    return lambda hf, cfg: {**hf, key: not hf.get(key, default)}


def _rope(**values: Any) -> Flip:
    """Change the RoPE entry (rope_parameters, as transformers >= 5 writes it)."""
    def flip(hf: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
        rope = {"rope_theta": hf["rope_parameters"]["rope_theta"], **values}
        return {**hf, "rope_parameters": rope}
    return flip


def _partial_rotary(hf: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    rope = dict(hf["rope_parameters"])
    rope["partial_rotary_factor"] = 0.25 if rope.get("partial_rotary_factor", 1.0) == 0.5 else 0.5
    return {**hf, "rope_parameters": rope}


def _theta(hf: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    return {**hf, "rope_parameters": {**hf["rope_parameters"], "rope_theta": 100.0}}


# name -> (the flip, the pattern an error refusing it must contain)
FLIPS: dict[str, tuple[Flip, str]] = {
    "attention_bias": (_toggle("attention_bias"), "attention_bias="),
    "mlp_bias": (_set(mlp_bias=True), "mlp_bias="),
    "qkv_bias": (_toggle("qkv_bias"), "qkv_bias="),
    "use_sliding_window": (_set(use_sliding_window=True, sliding_window=4, max_window_layers=0), "use_sliding_window="),
    "sliding_window": (_set(sliding_window=4), "sliding_window="),
    "max_window_layers": (_set(max_window_layers=0), "max_window_layers="),
    "layer_types": (lambda hf, cfg: {**hf, "layer_types": ["sliding_attention"] * cfg.num_layers}, "layer_types="),
    "rope_linear": (_rope(rope_type="linear", factor=2.0), "rope_(scaling|parameters)"),
    "rope_dynamic": (_rope(rope_type="dynamic", factor=2.0), "rope_(scaling|parameters)"),
    "rope_llama3": (_rope(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192), "rope_(scaling|parameters)"),
    "rope_yarn": (_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
                  "rope_(scaling|parameters)"),
    "rope_extra_key": (lambda hf, cfg: {**hf, "rope_parameters": {**hf["rope_parameters"], "mrope_section": [2, 2]}},
                       "mrope_section="),
    "partial_rotary_factor": (_partial_rotary, "partial_rotary_factor="),
    "tie_word_embeddings": (_toggle("tie_word_embeddings"), "tie_word_embeddings="),
    "head_dim": (lambda hf, cfg: {**hf, "head_dim": 2 * cfg.resolved_head_dim}, "head_dim="),
    "rms_norm_eps": (_set(rms_norm_eps=0.1), "rms_norm_eps="),
    "layer_norm_eps": (_set(layer_norm_eps=0.1), "layer_norm_eps="),
    "rope_theta": (_theta, "rope_theta="),
    # a base that is not a whole number (was truncated to 2 on the way into Megatron-core)
    "rope_theta_fractional": (lambda hf, cfg: {**hf, "rope_parameters": {**hf["rope_parameters"], "rope_theta": 2.5}},
                              "rope_theta="),
    # transformers reads mscale_all_dim without mscale differently from Megatron-core: refused wherever YaRN is not
    "rope_yarn_mscale_all_dim": (_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                                       mscale_all_dim=1.0), "rope_(scaling|parameters)"),
    "hidden_act": (_set(hidden_act="gelu"), "hidden_act="),
    "attn_logit_softcapping": (_set(attn_logit_softcapping=30.0), "attn_logit_softcapping="),
    "final_logit_softcapping": (_set(final_logit_softcapping=30.0), "final_logit_softcapping="),
    "attention_dropout": (_set(attention_dropout=0.5), "attention_dropout="),
    "pretraining_tp": (_set(pretraining_tp=2), "pretraining_tp="),
    "norm_topk_prob": (_toggle("norm_topk_prob"), "norm_topk_prob="),
    "use_qk_norm": (_toggle("use_qk_norm"), "use_qk_norm="),
    "unknown_switch": (_set(sparse_attention_blocks=16), "sparse_attention_blocks="),
}
CASES = [(family, flip) for family in sorted(FAMILIES) for flip in FLIPS]


def written_config(family: str) -> dict[str, Any]:
    """The family's tiny config.json as transformers writes it (every key, defaults included)."""
    return hf_config(FAMILIES[family]).to_dict()


def import_flipped(root: Path, family: str, flip: str) -> tuple[Path, Any]:
    """Write the flipped config.json under `root`; (its directory, the ModelConfig read from it, or the
    ValueError that refused it)."""
    path = root / f"{family}-{flip}"
    path.mkdir(parents=True, exist_ok=True)
    hf = FLIPS[flip][0](written_config(family), FAMILIES[family])
    (path / "config.json").write_text(json.dumps(hf))
    try:
        return path, ModelConfig(**arch_from_hf_config(path))
    except ValueError as exc:
        return path, exc


# query and key projections (multi-latent attention's up projections among them) and experts, which `sharpen`
# scales
_SHARPENED = ("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "experts.gate_up_proj",
              "experts.down_proj")


def build_checkpoint(path: Path, seed: int = 0, sharpen: float = 1.0) -> torch.nn.Module:
    """A transformers model built from the config.json at `path`, its biases, norm weights and untied output
    layer random as well (transformers starts them at 0, 1 and the embedding), its query and key projections
    and its experts times `sharpen` (attention far from uniform, so that RoPE's variants show; experts' outputs
    large enough that their weighting does), saved there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.5)
                elif "norm" in name:
                    param.normal_(1.0, 0.2)
                elif name == "lm_head.weight" and not config.tie_word_embeddings:
                    param.normal_(0.0, 0.05)
                elif name.endswith(_SHARPENED) or ".experts." in name:
                    param.mul_(sharpen)
    model.save_pretrained(path)
    return model


def _comparable(cfg: ModelConfig) -> dict[str, Any]:
    """The architecture fields, family defaults resolved (what a checkpoint's import determines)."""
    fields = {k: v for k, v in vars(cfg).items() if k not in ("name", "path", "tokenizer", "init_seed")}
    if not cfg.multi_latent_attention:
        fields.update(qkv_bias=cfg.resolved_qkv_bias, qk_layernorm=cfg.resolved_qk_layernorm,
                      head_dim=cfg.resolved_head_dim)
    return fields


def mapped_cases(root: Path) -> list[tuple[str, str]]:
    """The (family, flip) cases whose flipped config.json the import accepts with another architecture than
    the unflipped one's (written under `root`)."""
    cases = []
    for family, flip in CASES:
        _, cfg = import_flipped(root, family, flip)
        if not isinstance(cfg, ValueError) and changes_architecture(family, cfg):
            cases.append((family, flip))
    return cases


def changes_architecture(family: str, cfg: ModelConfig) -> bool:
    plain = ModelConfig(**arch_from_hf_config_dict(written_config(family)))
    return _comparable(cfg) != _comparable(plain)


def arch_from_hf_config_dict(hf: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf))
        return arch_from_hf_config(tmp)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 99, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits.double()


def test_every_family_is_in_the_table():
    assert family_names() == sorted(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_key_transformers_writes_is_classified(family):
    """The closed list: every key of the family's transformers config class, and of what the export writes, is
    mapped, fixed or ignored by name (a transformers upgrade that adds one fails here, not silently); the RoPE
    entry's keys are its type's."""
    from transformers import AutoConfig

    conv = get_converter(family)
    fields = conv.hf_fields
    assert not (fields.mapped & set(fields.ignored)) and not (fields.mapped & set(fields.fixed))
    assert not set(fields.fixed) & set(fields.ignored)
    written = {**AutoConfig.for_model(conv.model_type).to_dict(), **written_config(family),
               **conv.config_dict(FAMILIES[family])}
    assert sorted(set(written) - fields.known()) == []
    rope = written_config(family)["rope_parameters"]
    allowed = set(ROPE_KEYS[rope.get("rope_type", "default")]) | {"partial_rotary_factor"}
    assert set(rope) <= allowed


@pytest.mark.parametrize(("family", "flip"), CASES)
def test_a_flipped_key_is_imported_exactly_or_refused_by_name(tmp_path, family, flip):
    path, cfg = import_flipped(tmp_path, family, flip)
    if isinstance(cfg, ValueError):
        assert re.search(FLIPS[flip][1], str(cfg)), f"the error does not name the key: {cfg}"
        return
    model = build_checkpoint(path)
    cfg = ModelConfig(**arch_from_hf_config(path))  # as transformers wrote it back
    check_tensor_names(path, cfg)
    conv = get_converter(family)
    hf = hub_state_dict(model)
    back = conv.megatron_to_hf(conv.hf_to_megatron(hf, cfg), cfg)
    if cfg.tie_word_embeddings:
        back.pop("lm_head.weight", None)
        hf.pop("lm_head.weight", None)
    assert sorted(back) == sorted(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key
    if changes_architecture(family, cfg):
        return  # Megatron against transformers: tests/distributed/test_import_fields.py
    keys = {k for k in json.loads((path / "config.json").read_text()) if k in conv.hf_fields.ignored}
    flipped = FLIPS[flip][0](written_config(family), FAMILIES[family])
    changed = {k for k in flipped if flipped[k] != written_config(family).get(k)}
    off = {k for k in changed if not flipped[k] and k not in conv.hf_fields.known()}  # unknown, and off: nothing
    assert changed - off <= keys, f"{sorted(changed - off - keys)} accepted, not mapped, not on the ignored list"
    from transformers import AutoConfig, AutoModelForCausalLM

    plain = AutoConfig.for_model(conv.model_type, **{k: v for k, v in written_config(family).items()
                                                     if k != "model_type"})
    without = AutoModelForCausalLM.from_pretrained(path, config=plain, dtype=torch.float32).eval()
    assert (_logits(model) - _logits(without)).abs().max() <= TOL


def _tiny_checkpoint(root: Path, family: str = "qwen2") -> tuple[Path, ModelConfig]:
    from megatron_rl.models.hf import build_hf_model

    cfg = FAMILIES[family]
    build_hf_model(cfg, seed=0).save_pretrained(root)
    return root, ModelConfig(**arch_from_hf_config(root))


def _add_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file, save_file

    held = load_file(path / "model.safetensors")
    save_file({**held, **tensors}, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_every_unaccounted_tensor_is_named(tmp_path):
    path, cfg = _tiny_checkpoint(tmp_path)
    extra = {f"model.layers.{i}.self_attn.o_proj.bias": torch.zeros(cfg.hidden_size) for i in (0, 1)}
    _add_tensors(path, {**extra, "model.extra_scale": torch.ones(1)})
    with pytest.raises(ValueError, match=r"3 tensor\(s\) that model.family=qwen2 .* does not read.*"
                                         r"'model.extra_scale', 'model.layers.\{0,1\}.self_attn.o_proj.bias'"):
        check_tensor_names(path, cfg)
    from megatron_rl.checkpoint.hf import stage_tensors

    with pytest.raises(ValueError, match="o_proj.bias"):  # every load checks it too
        stage_tensors(path, cfg, range(cfg.num_layers), True, True)


def test_every_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path, cfg = _tiny_checkpoint(tmp_path)
    held = load_file(path / "model.safetensors")
    for i in (0, 1):
        del held[f"model.layers.{i}.self_attn.k_proj.bias"]
    del held["model.norm.weight"]
    save_file(held, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.\{0,1\}.self_attn.k_proj.bias', "
                                         r"'model.norm.weight' \(3 missing\)"):
        check_tensor_names(path, cfg)


def test_rotary_caches_and_a_tied_output_layer_are_ignored_by_name(tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.checkpoint.hf import stage_tensors

    path, cfg = _tiny_checkpoint(tmp_path)  # qwen2: tied embeddings
    assert cfg.tie_word_embeddings
    embedding = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    _add_tensors(path, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16),
                        "model.rotary_emb.inv_freq": torch.ones(16), "lm_head.weight": embedding.clone()})
    check_tensor_names(path, cfg)
    assert "lm_head.weight" not in stage_tensors(path, cfg, range(cfg.num_layers), True, True)


def test_a_tied_config_with_another_output_layer_is_refused(tmp_path):
    """transformers (>= 5) computes with a stored lm_head that is not the embedding, whatever
    tie_word_embeddings says: reading the model as tied would compute another one."""
    from megatron_rl.checkpoint.hf import stage_tensors

    path, cfg = _tiny_checkpoint(tmp_path)
    _add_tensors(path, {"lm_head.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size)})
    with pytest.raises(ValueError, match="'lm_head.weight' differs from 'model.embed_tokens.weight', but config.json "
                                         "says tie_word_embeddings=true"):
        stage_tensors(path, cfg, range(cfg.num_layers), True, True)


@pytest.mark.parametrize(("family", "ignored"), [("glm4_moe", True), ("deepseek_v3", True), ("llama", False)])
def test_prediction_layers_are_ignored_where_the_family_has_them(tmp_path, family, ignored):
    """GLM-4.5 and DeepSeek store their multi-token-prediction layers after the decoder's; elsewhere a layer
    past num_hidden_layers is a mismatch."""
    path, cfg = _tiny_checkpoint(tmp_path, family)
    _add_tensors(path, {f"model.layers.{cfg.num_layers}.eh_proj.weight": torch.zeros(4, 4)})
    if ignored:
        check_tensor_names(path, cfg)
    else:
        with pytest.raises(ValueError, match=rf"'model.layers.{cfg.num_layers}.eh_proj.weight'"):
            check_tensor_names(path, cfg)


def test_every_refused_key_is_named_in_one_error(tmp_path):
    hf = {**written_config("llama"), "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
          "partial_rotary_factor": 0.5, "use_sliding_window": False}  # off: nothing to refuse
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError) as info:
        arch_from_hf_config(tmp_path)
    message = str(info.value)
    for key in ("attn_logit_softcapping=50.0", "final_logit_softcapping=30.0", "partial_rotary_factor=0.5"):
        assert key in message
    assert "use_sliding_window" not in message


# config.json keys of published checkpoints (transformers 4 spelling), the values shrunk: all accepted
PUBLISHED = {
    "llama": {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
              "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 131072,
              "mlp_bias": False, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
              "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 256},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
              "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
              "intermediate_size": 128, "max_position_embeddings": 32768, "max_window_layers": 28,
              "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 131072,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
              "use_cache": True, "use_sliding_window": False, "vocab_size": 256},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
              "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 40960,
              "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 256},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
                "intermediate_size": 96, "max_position_embeddings": 32768, "model_type": "mixtral",
                "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
                "num_local_experts": 4, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6,
                "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True,
                "vocab_size": 256},
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
                 "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 32,
                 "hidden_act": "silu", "hidden_size": 64, "partial_rotary_factor": 0.5, "initializer_range": 0.02,
                 "intermediate_size": 128, "max_position_embeddings": 131072, "model_type": "glm4_moe",
                 "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "n_group": 1,
                 "topk_group": 1, "n_routed_experts": 4, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                 "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 2,
                 "num_key_value_heads": 2, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05,
                 "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                 "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": False, "vocab_size": 256},
}


@pytest.mark.parametrize("family", sorted(PUBLISHED))
def test_published_config_keys_are_all_accounted_for(tmp_path, family):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[family]))
    assert ModelConfig(**arch_from_hf_config(tmp_path)).family == family


def test_mlp_bias_is_refused_for_sglang_engines():
    """SGLang's Llama builds its MLP without biases and would drop them (its loader skips unknown biases)."""
    from megatron_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.mlp_bias=true is not supported with rollout.backend=sglang"):
        load_config(["model=tiny_llama", "model.mlp_bias=true", "rollout=sglang"], world_size=1)
    assert load_config(["model=tiny_llama", "model.mlp_bias=true"], world_size=1).model.mlp_bias


def test_mlp_bias_is_llamas_alone():
    with pytest.raises(ValueError, match="model.mlp_bias=true is invalid: only model.family=llama"):
        ModelConfig(family="qwen3", mlp_bias=True)
