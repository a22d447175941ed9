"""`rollout.*` -> engine: the sglang settings, the checks before any work starts, and what
`make_engine` builds for each backend (no processes; SGLang itself is exercised in
tests/integration/test_sglang_*.py)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.config.schema import ModelConfig, RolloutConfig, TrainConfig
from megatron_rl.rollout.factory import check_engine_config, engine_model_dir, make_engine, sglang_engine_config

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


def rl_config(**rollout) -> TrainConfig:
    return TrainConfig(mode="rl", run_dir="unused", rollout=RolloutConfig(**rollout))


@pytest.mark.parametrize("key,value", [("base_url", "http://h:1"), ("attention_backend", "fa3"),
                                       ("chunked_prefill_size", 4096), ("disable_radix_cache", True),
                                       ("kv_cache_dtype", "fp8_e4m3"), ("server_args", {"max_running_requests": 8})])
def test_sglang_settings_are_refused_with_the_hf_backend(key, value):
    with pytest.raises(ValueError, match=f"rollout.{key}=.*is an SGLang setting but rollout.backend=hf"):
        RolloutConfig(backend="hf", **{key: value})


@pytest.mark.parametrize("key,value,message", [("log_level", "loud", "allowed values are debug, info"),
                                               ("base_url", "localhost:30000", "must be an http"),
                                               ("chunked_prefill_size", 0, "must be >= 1"),
                                               ("max_total_tokens", 0, "must be >= 1")])
def test_bad_sglang_settings(key, value, message):
    with pytest.raises(ValueError, match=f"rollout.{key}=.*{message}"):
        RolloutConfig(backend="sglang", **{key: value})


def test_sglang_engine_arguments_from_the_config():
    cfg = rl_config(backend="sglang", tp=2, mem_fraction_static=0.4, attention_backend="fa3",
                    chunked_prefill_size=4096, disable_radix_cache=True, kv_cache_dtype="fp8_e4m3",
                    log_level="warning", server_args={"max_running_requests": 64, "chunked_prefill_size": 2048})
    cfg.model = dataclasses.replace(cfg.model, dtype="bfloat16")
    kwargs = sglang_engine_config(cfg, device_type="cuda", model_path="/run/model", base_gpu_id=4,
                                  random_seed=7).engine_kwargs()
    assert kwargs == {"model_path": "/run/model", "tp_size": 2, "base_gpu_id": 4, "dtype": "bfloat16",
                      "mem_fraction_static": 0.4, "random_seed": 7, "weight_version": "0", "skip_tokenizer_init": True,
                      "log_level": "warning", "enable_memory_saver": True, "load_format": "dummy",
                      "attention_backend": "fa3", "disable_radix_cache": True, "kv_cache_dtype": "fp8_e4m3",
                      "max_running_requests": 64, "chunked_prefill_size": 2048}  # server_args win
    cpu = sglang_engine_config(rl_config(backend="sglang", max_total_tokens=4096), device_type="cpu",
                               model_path="/m", base_gpu_id=0, random_seed=0).engine_kwargs()
    assert cpu["attention_backend"] == "torch_native" and cpu["enable_memory_saver"] is False
    assert cpu["max_total_tokens"] == 4096 and "base_gpu_id" not in cpu
    attach = sglang_engine_config(rl_config(backend="sglang", base_url="http://node1:30000"), device_type="cuda",
                                  model_path=None, base_gpu_id=0, random_seed=0)
    assert attach.base_url == "http://node1:30000" and attach.model_path is None
    trusted = rl_config(backend="sglang")
    trusted.model = dataclasses.replace(trusted.model, trust_remote_code=True)
    kwargs = sglang_engine_config(trusted, device_type="cuda", model_path="/m", base_gpu_id=0, random_seed=0)
    assert kwargs.engine_kwargs()["trust_remote_code"] is True  # model.trust_remote_code reaches SGLang
    assert "trust_remote_code" not in cpu


def test_adapter_sync_starts_sglang_with_lora_serving_for_the_runs_adapters():
    cfg = TrainConfig(mode="rl", run_dir="unused", rollout=RolloutConfig(backend="sglang", weight_sync="adapters"),
                      model=ModelConfig(lora_rank=8, lora_targets=["linear_qkv", "linear_fc2"]))
    gpu = sglang_engine_config(cfg, device_type="cuda", model_path="/m", base_gpu_id=0, random_seed=0).engine_kwargs()
    assert (gpu["enable_lora"], gpu["max_lora_rank"], gpu["max_loras_per_batch"]) == (True, 8, 2)
    assert "lora_backend" not in gpu  # SGLang's choice
    assert gpu["lora_target_modules"] == ["down_proj", "k_proj", "q_proj", "v_proj"]
    cpu = sglang_engine_config(cfg, device_type="cpu", model_path="/m", base_gpu_id=0, random_seed=0).engine_kwargs()
    assert cpu["lora_backend"] == "torch_native"  # the only one without GPU kernels
    full = sglang_engine_config(rl_config(backend="sglang"), device_type="cpu", model_path="/m", base_gpu_id=0,
                                random_seed=0).engine_kwargs()
    assert "enable_lora" not in full and "lora_backend" not in full


@pytest.mark.parametrize("model,copy", [("tiny_qwen3_moe", True), ("tiny_qwen3", False), ("tiny_qwen2", False),
                                        ("tiny_mixtral", False)])
def test_a_tied_head_goes_to_sglang_classes_that_keep_one_of_their_own(model, copy):
    """SGLang's Qwen3-MoE class ignores tie_word_embeddings (its lm_head is a parameter of its own), its Qwen2 and
    Qwen3 classes tie it; Mixtral's is untied anyway. Weight sync leaves a tied head out, so for the first the
    engine's buckets carry the embedding as lm_head.weight too (the same tensor: nothing is copied here)."""
    import torch

    from megatron_rl.config import compose, to_typed
    from megatron_rl.rollout.sglang_engine import with_head_copy

    cfg = to_typed(compose([f"model={model}", "rollout=sglang"]))
    assert cfg.model.tie_word_embeddings is (model != "tiny_mixtral")
    for device in ("cuda", "cpu"):
        engine = sglang_engine_config(cfg, device_type=device, model_path="/m", base_gpu_id=0, random_seed=0)
        assert engine.head_copy is copy and "head_copy" not in engine.engine_kwargs()
    attach = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, base_url="http://h:1"))
    assert sglang_engine_config(attach, device_type="cuda", model_path=None, base_gpu_id=0,
                                random_seed=0).head_copy is copy
    piped = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, server_args={"pp_size": 2}))
    tied = model != "tiny_mixtral"  # under SGLang's pipeline parallelism no class ties the head
    assert sglang_engine_config(piped, device_type="cuda", model_path="/m", base_gpu_id=0,
                                random_seed=0).head_copy is tied
    embedding, norm, layer = torch.randn(128, 8), torch.ones(8), torch.randn(8, 8)
    out = with_head_copy([("model.embed_tokens.weight", embedding), ("model.norm.weight", norm)])
    assert [name for name, _ in out] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert out[2][1] is embedding
    assert [name for name, _ in with_head_copy([("model.layers.0.mlp.gate.weight", layer)])] == [
        "model.layers.0.mlp.gate.weight"]  # a bucket without the embedding is left as it is


def test_stop_strings_give_the_sglang_engine_the_runs_tokenizer(tmp_path):
    """rollout.stop with the sglang backend: the run's tokenizer is saved beside the engine's model directory
    and the engine loads it (SGLang matches stop strings on text); without stop strings it runs token ids
    only; an attached server is declared to have one."""
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rollout.factory import _engine_dirs

    tokenizer = load_tokenizer("builtin:char")
    cfg = rl_config(backend="sglang", stop=["}"])
    model_path, tokenizer_path = _engine_dirs(cfg, tokenizer, tmp_path, "rollout_model_rank0")
    assert load_tokenizer(tokenizer_path).encode("a}b") == tokenizer.encode("a}b")
    kwargs = sglang_engine_config(cfg, device_type="cuda", model_path=model_path, base_gpu_id=0, random_seed=0,
                                  tokenizer_path=tokenizer_path).engine_kwargs()
    assert kwargs["skip_tokenizer_init"] is False and kwargs["tokenizer_path"] == tokenizer_path
    plain = rl_config(backend="sglang")
    assert _engine_dirs(plain, tokenizer, tmp_path / "plain", "m")[1] is None
    assert sglang_engine_config(plain, device_type="cuda", model_path=model_path, base_gpu_id=0,
                                random_seed=0).engine_kwargs()["skip_tokenizer_init"] is True
    attach = rl_config(backend="sglang", base_url="http://node1:30000", stop=["}"])
    assert _engine_dirs(attach, tokenizer, tmp_path / "attach", "m") == (None, None)
    assert sglang_engine_config(attach, device_type="cuda", model_path=None, base_gpu_id=0,
                                random_seed=0).skip_tokenizer_init is False


def test_rollout_tp_must_divide_the_ranks_of_a_node():
    with pytest.raises(ConfigError, match="rollout.tp=3 does not divide the 4 ranks per node.*values are 1, 2, 4"):
        check_engine_config(rl_config(tp=3), world_size=8, local_world_size=4)
    check_engine_config(rl_config(tp=2), world_size=8, local_world_size=4)


def test_attach_mode_serves_one_block():
    with pytest.raises(ConfigError, match="job has 4 ranks: set rollout.tp=4"):
        check_engine_config(rl_config(backend="sglang", tp=2, base_url="http://h:1"), world_size=4,
                            local_world_size=4)


def test_sglangs_mixtral_is_refused_with_rope_scaling():
    """SGLang's Mixtral class builds plain RoPE whatever config.json says (rollout.md); the run stops before
    any work. Without scaling, or with the hf engine, it runs."""
    cfg = rl_config(backend="sglang")
    cfg.model = ModelConfig(family="mixtral", num_experts=4, moe_ffn_hidden_size=64, ffn_hidden_size=64,
                            rope_scaling_type="yarn", rope_scaling_factor=4.0,
                            rope_scaling_original_max_position_embeddings=128)
    with pytest.raises(ConfigError, match=r"model.rope_scaling_factor=4.0 \(YaRN scaling\) with model.family=mixtral: "
                                          "SGLang's Mixtral ignores rope scaling"):
        check_engine_config(cfg, world_size=1, local_world_size=1)
    cfg.rollout = RolloutConfig(backend="hf")
    check_engine_config(cfg, world_size=1, local_world_size=1)


@pytest.mark.skipif(HAVE_SGLANG, reason="sglang is installed in this venv")
def test_without_sglang_the_run_stops_before_any_work():
    from megatron_rl.runtime import load_validated

    with pytest.raises(ConfigError, match="rollout.backend=sglang needs sglang.*tests/integration/sglang/setup.sh"):
        load_validated(["mode=rl", "rollout=sglang", "task=arithmetic"], world_size=1)


MOE_MODELS = {"qwen3_moe": ModelConfig(family="qwen3_moe", num_experts=4, moe_ffn_hidden_size=64),
              "mixtral": ModelConfig(family="mixtral", num_experts=4, moe_ffn_hidden_size=64, ffn_hidden_size=64),
              "qwen2_moe": ModelConfig(family="qwen2_moe", num_experts=4, moe_ffn_hidden_size=64,
                                       moe_shared_expert_intermediate_size=96, moe_norm_topk_prob=False),
              "glm4_moe": ModelConfig(family="glm4_moe", num_experts=4, moe_ffn_hidden_size=64,
                                      moe_shared_expert_intermediate_size=128, moe_dense_layers=[0],
                                      rotary_percent=0.5, moe_routed_scaling_factor=2.5),
              "deepseek_v3": ModelConfig(family="deepseek_v3", num_query_groups=4, num_experts=4,
                                         moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64,
                                         moe_dense_layers=[0], moe_routed_scaling_factor=2.5, q_lora_rank=32,
                                         kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                                         rope_scaling_factor=8.0, max_position_embeddings=512,
                                         rope_scaling_original_max_position_embeddings=64,
                                         rope_scaling_mscale=1.0, rope_scaling_mscale_all_dim=1.0),
              "deepseek_v2": ModelConfig(family="deepseek_v2", num_query_groups=4, num_experts=4,
                                         moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=128,
                                         moe_norm_topk_prob=False, moe_dense_layers=[0], q_lora_rank=None,
                                         kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24)}


@pytest.mark.parametrize("family", sorted(MOE_MODELS))
def test_hf_engine_takes_moe_weights_in_the_hub_layout(family):
    """Weight sync sends per-expert hub tensors (`experts.{e}.w1`, ...); transformers holds the
    experts fused. After an update from another model's hub state dict the engine holds that
    model's weights and computes its logits."""
    import torch

    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = rl_config()
    cfg.model = MOE_MODELS[family]
    check_engine_config(cfg, world_size=1, local_world_size=1)
    source = build_hf_model(cfg.model, seed=7)
    if family in ("glm4_moe", "deepseek_v3"):  # the router's selection bias is a buffer, initialised to 0
        with torch.no_grad():
            source.model.layers[-1].mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.5, -1.0, 2.0, 0.1]))
    sent = hub_state_dict(source)
    assert any(".experts.3." in k for k in sent)  # per-expert names, not transformers' fused ones
    engine = HFEngine(cfg.model)
    before = engine.model.model.layers[-1].mlp.experts.gate_up_proj.detach().clone()
    assert not torch.equal(before, source.model.layers[-1].mlp.experts.gate_up_proj)  # a real update follows
    engine.update_weights(sorted(sent.items(), reverse=True), version=1)  # any order, one tensor at a time
    held = engine.hf_state_dict()
    assert sorted(held) == sorted(sent)
    for key, value in sent.items():
        assert torch.equal(held[key], value), key
    tokens = torch.tensor([[5, 9, 2, 40, 7, 7, 3]])
    with torch.no_grad():
        assert torch.equal(engine.model(tokens).logits, source(tokens).logits)


def test_hf_engine_keeps_glm4_moe_routing_in_fp32_at_bf16():
    """transformers keeps GLM-4.5's router weight and selection bias in fp32 whatever the model's
    dtype; the bf16 engine does too, so a synced fp32 bias arrives unrounded."""
    import dataclasses

    import torch

    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = dataclasses.replace(MOE_MODELS["glm4_moe"], dtype="bfloat16")
    engine = HFEngine(cfg)
    router = engine.model.model.layers[-1].mlp.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert engine.model.model.layers[-1].mlp.shared_experts.gate_proj.weight.dtype == torch.bfloat16
    bias = torch.tensor([1e-3, 1 + 2 ** -12, -0.3, 0.0])  # 1 + 2^-12 is not a bf16 number
    engine.update_weights([(f"model.layers.{cfg.num_layers - 1}.mlp.gate.e_score_correction_bias", bias)], 1,
                          flush=False)  # one tensor of an update
    assert torch.equal(router.e_score_correction_bias, bias)


def test_hf_engine_latent_norms_take_the_trainers_epsilon():
    """Moonlight's rms_norm_eps is 1e-5; transformers gives DeepSeek-V3's latent norms 1e-6 regardless,
    Megatron-core (and SGLang) rms_norm_eps. The engine follows the trainer, and that changes its logits."""
    import dataclasses

    import torch

    from megatron_rl.models.hf import build_hf_model
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = dataclasses.replace(MOE_MODELS["deepseek_v3"], norm_eps=1e-2)  # large, to see it in the logits
    engine = HFEngine(cfg)
    plain = build_hf_model(cfg, seed=0)
    attention = engine.model.model.layers[1].self_attn
    assert attention.q_a_layernorm.variance_epsilon == attention.kv_a_layernorm.variance_epsilon == 1e-2
    assert plain.model.layers[1].self_attn.kv_a_layernorm.variance_epsilon == 1e-6  # transformers' own
    assert engine.model.model.layers[1].input_layernorm.variance_epsilon == 1e-2
    tokens = torch.tensor([[5, 9, 2, 40, 7, 7, 3]])
    with torch.no_grad():
        assert (engine.model(tokens).logits - plain(tokens).logits).abs().max() > 1e-4


@pytest.mark.parametrize("family", sorted(MOE_MODELS))
def test_engine_model_dir_holds_the_moe_architecture(tmp_path, family):
    """What SGLang starts an MoE model from: transformers reads back the experts and their width."""
    from transformers import AutoConfig

    cfg = rl_config(backend="sglang")
    cfg.model = MOE_MODELS[family]
    hf = AutoConfig.from_pretrained(engine_model_dir(cfg, eos_token_id=3, work_dir=tmp_path / "m"))
    width = hf.intermediate_size if family == "mixtral" else hf.moe_intermediate_size
    assert (hf.model_type, hf.num_experts_per_tok, width) == (family, 2, 64)
    assert getattr(hf, "num_local_experts", getattr(hf, "num_experts", None)) == 4
    if family == "qwen2_moe":
        assert (hf.shared_expert_intermediate_size, hf.norm_topk_prob) == (96, False)
    if family == "glm4_moe":
        assert (hf.n_shared_experts, hf.first_k_dense_replace, hf.routed_scaling_factor) == (2, 1, 2.5)
        assert hf.rope_parameters["partial_rotary_factor"] == 0.5
    if family == "deepseek_v2":
        assert (hf.q_lora_rank, hf.n_shared_experts, hf.topk_method, hf.scoring_func) == (None, 2, "greedy", "softmax")
    if family == "deepseek_v3":
        assert (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim) == (
            32, 32, 16, 8, 24)
        rope = hf.rope_parameters
        assert (rope["rope_type"], rope["factor"], hf.rope_interleave) == ("yarn", 8.0, True)
        assert (hf.n_shared_experts, hf.first_k_dense_replace, hf.routed_scaling_factor) == (1, 1, 2.5)
        # SGLang's DeepseekV2 model reads these, which transformers does not define (it stopped at the
        # first, moe_layer_freq, when tried)
        assert (hf.moe_layer_freq, hf.scoring_func, hf.topk_method) == (1, "sigmoid", "noaux_tc")


def test_engine_model_dir_holds_the_architecture(tmp_path):
    from transformers import AutoConfig

    cfg = rl_config(backend="sglang")
    path = engine_model_dir(cfg, eos_token_id=3, work_dir=tmp_path / "m")
    hf = AutoConfig.from_pretrained(path)
    m = cfg.model
    assert (hf.model_type, hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, hf.vocab_size) == \
           (m.family, m.num_layers, m.hidden_size, m.ffn_hidden_size, m.vocab_size)
    assert hf.eos_token_id == 3
    assert not list((tmp_path / "m").glob("*.safetensors"))  # weights come by sync


def test_hf_backend_builds_one_engine_per_rank(tmp_path, caplog):
    import logging

    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rollout.hf_engine import HFEngine

    import types

    import torch

    groups = types.SimpleNamespace(device=torch.device("cpu"), rank=0)  # the engine runs on the rank's device
    with caplog.at_level(logging.INFO, logger="megatron_rl.rollout.factory"):
        engine = make_engine(rl_config(), groups, load_tokenizer("builtin:char"), local_rank=0, local_world_size=1,
                             work_dir=tmp_path)
    assert isinstance(engine, HFEngine) and engine.device == groups.device
    assert "rollout engine: transformers generate (hf) on cpu, one per 1 rank(s)" in caplog.text  # the choice, logged


def test_hf_engine_refuses_an_update_that_leaves_weights_unwritten():
    """After release / resume the engine's memory is uninitialised: an update that skips a weight (a
    converter bug) must fail at its flush, not generate from garbage; a complete one is taken."""
    import torch

    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.base import EngineStateError
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = rl_config()
    engine = HFEngine(cfg.model)
    sent = hub_state_dict(build_hf_model(cfg.model, seed=7))
    partial = [(k, v) for k, v in sent.items() if "layers.1.mlp.down_proj" not in k]
    with pytest.raises(EngineStateError, match=r"left 1 engine parameters unwritten .*layers.1.mlp.down_proj"):
        engine.update_weights(partial, version=1)  # even the first update: random init is no policy
    engine.update_weights(sent.items(), version=1)
    engine.release_memory()
    engine.resume_memory()
    engine.update_weights(partial[:3], version=2, flush=False)  # buckets before the last one are not checked
    with pytest.raises(EngineStateError, match="unwritten"):
        engine.update_weights(partial[3:], version=2)
    assert engine.weight_version == 1
    engine.update_weights(sent.items(), version=2)
    held = engine.hf_state_dict()
    assert all(torch.equal(held[k], v) for k, v in sent.items()) and engine.weight_version == 2



def test_hf_engine_refuses_an_update_that_skips_one_expert_of_a_fused_tensor():
    """transformers holds a mixture of experts' experts fused (mlp.experts.gate_up_proj [E, 2I, H]); weight sync
    sends them one hub tensor each, a slice of that parameter. An update that skips one slice (one expert's
    up_proj) leaves it uninitialised after a release / resume: refused at the flush like a whole missing weight,
    and taken once the slice arrives."""
    import torch

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.base import EngineStateError
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = ModelConfig(family="qwen3_moe", num_experts=4, moe_ffn_hidden_size=48, head_dim=48,
                      tie_word_embeddings=False)
    engine = HFEngine(cfg)
    sent = hub_state_dict(build_hf_model(cfg, seed=7))
    skipped = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert skipped in sent
    partial = [(k, v) for k, v in sent.items() if k != skipped]
    engine.update_weights(sent.items(), version=1)
    engine.release_memory()
    engine.resume_memory()
    with pytest.raises(EngineStateError, match=r"left 1 engine parameters unwritten .*layers.1.mlp.experts.gate_up_proj"):
        engine.update_weights(partial, version=2)
    assert engine.weight_version == 1
    engine.update_weights([(skipped, sent[skipped])], version=2)  # the missing slice completes it
    held = engine.hf_state_dict()
    assert all(torch.equal(held[k], v) for k, v in sent.items()) and engine.weight_version == 2

def test_hf_engine_keeps_a_tied_lm_head_tied_after_a_release():
    """A tied lm_head is the embedding (weight sync sends it once): after release / resume it still is, one
    tensor, written by the embedding's update; an untied one is written by its own."""
    import torch

    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.hf_engine import HFEngine

    for tied in (True, False):
        cfg = dataclasses.replace(rl_config().model, tie_word_embeddings=tied)
        engine = HFEngine(cfg)
        sent = {k: v for k, v in hub_state_dict(build_hf_model(cfg, seed=7)).items()
                if not (tied and k == "lm_head.weight")}
        engine.release_memory()
        engine.resume_memory()
        engine.update_weights(sent.items(), version=1)
        model = engine.model
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        assert torch.equal(model.lm_head.weight, sent["lm_head.weight" if not tied else "model.embed_tokens.weight"])


def test_hf_engine_unseeded_requests_draw_new_samples():
    """A seeded request is reproducible and leaves the global generator alone; unseeded ones draw
    from it, so two of them differ (forking the generator for them repeated the same samples)."""
    import torch

    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = rl_config()
    engine = HFEngine(cfg.model)
    engine.update_weights(hub_state_dict(build_hf_model(cfg.model, seed=7)).items(), version=1)
    prompts = [[5, 9, 2, 40]] * 4

    def draw(seed=None):
        return [g.output_ids for g in engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=seed))]

    state = torch.random.get_rng_state()
    assert draw(seed=3) == draw(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert draw() != draw()


def _char_engine():
    """(config, the shipped tokenizer, an hf engine holding a fixed model of seed 7): stop-string tests' engine."""
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = rl_config()
    tokenizer = load_tokenizer("builtin:char")
    engine = HFEngine(cfg.model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      tokenizer=tokenizer)
    engine.update_weights(hub_state_dict(build_hf_model(cfg.model, seed=7)).items(), version=1)
    return cfg, tokenizer, engine


def test_hf_engine_stops_at_a_stop_string():
    """Greedy decoding (top_k=1) of a fixed model gives a known continuation; with a stop string taken
    from it, the response ends with the token that completes the string's first occurrence, finish
    reason stop, log-probs cut alike. The shipped tokenizer has one token per character."""
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg, tokenizer, engine = _char_engine()
    prompt = tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(top_k=1, max_new_tokens=16, seed=0)
    free = engine.generate([prompt], greedy)[0]
    text = tokenizer.decode(free.output_ids, skip_special_tokens=False)
    assert free.finish_reason == "length" and len(text) == 16
    stop = text[5:7]  # ends at character 7 (or earlier, where it occurs first)
    end = text.find(stop) + len(stop)
    got = engine.generate([prompt], dataclasses.replace(greedy, stop=(stop, "never-there")))[0]
    assert got.output_ids == free.output_ids[:end] and got.logprobs == free.logprobs[:end]
    assert got.finish_reason == "stop" and tokenizer.decode(got.output_ids).endswith(stop)
    with pytest.raises(ValueError, match="need the engine's tokenizer"):
        HFEngine(cfg.model).generate([prompt], dataclasses.replace(greedy, stop=("x",)))


def test_hf_engine_matches_stop_strings_on_the_response_alone():
    """A stop string that the prompt's last character begins and the response's first completes is no stop (as in
    SGLang, which matches the response's text): the response is what it is without the string, or ends where the
    string first occurs in the response's own text. transformers' stop_strings matched the whole sequence and
    ended the row after its first token, padding it with tokens the model never sampled."""
    from megatron_rl.rollout.base import SamplingParams

    _, tokenizer, engine = _char_engine()
    prompt = tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(top_k=1, max_new_tokens=16, seed=0)
    free = engine.generate([prompt, prompt[:-1]], greedy)[0]
    text = tokenizer.decode(free.output_ids, skip_special_tokens=False)
    assert free.finish_reason == "length" and len(text) == 16
    stop = "=" + text[0]  # the prompt's "=" and the response's first character
    got = engine.generate([prompt, prompt[:-1]], dataclasses.replace(greedy, stop=(stop,)))[0]
    if stop in text:
        end = text.find(stop) + len(stop)
        assert got.output_ids == free.output_ids[:end] and got.finish_reason == "stop"
    else:
        assert got.output_ids == free.output_ids and got.finish_reason == "length"
    assert got.logprobs == free.logprobs[:len(got.output_ids)]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_hf_engine_returns_the_routing_of_every_token_it_fed(family):
    """SamplingParams(return_routing=True): each generation's routing [prompt + response - 1, MoE layers, k]
    is what the model's routers choose on one forward over the prompt and the response without its last
    token (each response token is fed after it is sampled; the last never is). Batched, left-padded
    prompts of different lengths, two samples each; dense layers (glm4-style layer 0) have no column."""
    import torch

    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.hf_engine import HFEngine

    from tests.distributed.test_gpt_oss import ARCH as GPT_OSS

    model_cfg = MOE_MODELS[family] if family in MOE_MODELS else ModelConfig(**GPT_OSS)
    source = build_hf_model(model_cfg, seed=7)
    engine = HFEngine(model_cfg, eos_token_id=1, pad_token_id=0)
    engine.update_weights(sorted(hub_state_dict(source).items()), version=1)
    prompts = [[5, 9, 2, 40], [7, 3, 11, 12, 13, 30, 31], [8]]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=3, return_routing=True))
    routers = [(i, layer.mlp.gate if hasattr(layer.mlp, "gate") else layer.mlp.router)
               for i, layer in enumerate(source.model.layers) if model_cfg.is_sparse_layer(i)]
    assert len(gens) == 6 and len(routers) == model_cfg.num_layers - len(model_cfg.moe_dense_layers)
    for gen in gens:
        fed = prompts[gen.prompt_index] + gen.output_ids[:-1]
        seen = []
        handles = [router.register_forward_hook(lambda m, a, out: seen.append(out[2])) for _, router in routers]
        with torch.no_grad():
            source(torch.tensor([fed]))
        for handle in handles:
            handle.remove()
        expected = torch.stack(seen, dim=1)  # [len(fed), layers, k]
        assert gen.routing.shape == (len(fed), len(routers), model_cfg.moe_router_topk)
        assert gen.routing.dtype == torch.int16
        assert torch.equal(gen.routing.long().sort(-1).values, expected.sort(-1).values)
