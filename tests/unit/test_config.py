"""Config schema, YAML tree and loader: every YAML composes, overrides apply, bad input fails early.

Each invalid case must raise ConfigError whose one-line message names the key and the value.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from megatron_rl.config import (
    CONF_DIR,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    compose,
    load_config,
    to_typed,
    validate,
)
from megatron_rl.config import loader
from megatron_rl.config.schema import SCHEMAS

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL_YAMLS = sorted(CONF_DIR.rglob("*.yaml"))
# What conf/preset/tiny.yaml sets over the group defaults (the default model, tiny_qwen2, includes it)
TINY_PRESET = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "preset" / "tiny.yaml"))
# parallel.* null: on when the trainer runs on GPUs, off on CPU (ParallelConfig.resolve_device_defaults)
DEVICE_DEFAULTS = (
    "parallel.use_distributed_optimizer", "parallel.overlap_grad_reduce", "parallel.overlap_param_gather")


@pytest.fixture
def hf_checkpoint(tmp_path: Path) -> Path:
    """A directory that passes the model.path checks: config.json, whole weights (a safetensors file as long
    as its header says) and a tokenizer file; the contents are not read at config time."""
    import numpy as np
    from safetensors.numpy import save_file

    ckpt = tmp_path / "hf_ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    save_file({"a": np.zeros(3, np.float32), "b": np.ones(5, np.float32)}, str(ckpt / "model.safetensors"))
    (ckpt / "tokenizer.json").write_text("{}")
    return ckpt


def _shard(ckpt: Path, name: str) -> Path:
    """The checkpoint's weights moved into the shard `name` of an index."""
    (ckpt / "model.safetensors").rename(ckpt / name)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": name, "b": name}}))
    return ckpt / name


def _selecting(yaml_path: Path) -> tuple[str, list[str], str]:
    """(config_name, overrides) that select this YAML file, and the key its body is merged at."""
    rel = yaml_path.relative_to(CONF_DIR)
    if len(rel.parts) == 1:
        return rel.stem, [], ""  # a primary config
    group, name = "/".join(rel.parts[:-1]), rel.stem
    if group == "preset":  # included by the model files (tiny.yaml by the default model, tiny_qwen2)
        return "config", [], ""
    package = "" if "# @package _global_" in yaml_path.read_text() else group.replace("/", ".")
    selector = f"{group}={name}" if group in SCHEMAS else f"+{group}={name}"
    return "config", [selector], package


def _leaves(node: object, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        out: dict[str, object] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


# the GPU recipes need their data and checkpoint paths and a GPU job's world: tests/unit/test_recipes.py
GPU_RECIPES = {"qwen2_5_7b_math", "qwen3_8b_code", "qwen3_30b_a3b_math"}
# a distillation recipe's teacher must be a loadable checkpoint with the student's tokenizer: tests/unit/test_distill.py
DISTILL_RECIPES = {"smollm2_distill"}


@pytest.mark.parametrize("yaml_path", [p for p in ALL_YAMLS if p.stem not in GPU_RECIPES | DISTILL_RECIPES],
                         ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_every_yaml_composes_to_a_valid_typed_config(yaml_path: Path, hf_checkpoint: Path) -> None:
    config_name, overrides, package = _selecting(yaml_path)
    raw = OmegaConf.to_container(OmegaConf.load(yaml_path), resolve=False)
    assert isinstance(raw, dict)
    raw.pop("defaults", None)
    raw.pop("hydra", None)
    leaves = {f"{package}.{k}" if package else k: v for k, v in _leaves(raw).items()}
    # Mandatory values (???) get an existing checkpoint directory, like a user would pass.
    # (task=math's data: the example rows).
    given = {"task.path": CONF_DIR.parent / "docs" / "examples" / "math.jsonl"}
    overrides += [f"{key}={given.get(key, hf_checkpoint)}" for key, value in leaves.items() if value == "???"]
    cfg = to_typed(compose(overrides, config_name=config_name))
    if cfg.rollout.backend == "sglang" and importlib.util.find_spec("sglang") is None:
        with pytest.raises(ConfigError, match="rollout.backend=sglang needs sglang"):  # the checks say so first
            validate(cfg, world_size=1)
    elif cfg.sandbox.runtime == "apptainer" and not cfg.sandbox.images:  # countdown runs code: no image, no run
        with pytest.raises(ConfigError, match=r"apptainer .* needs an image .* docs/examples/python.def"):
            validate(cfg, world_size=1)
        validate(to_typed(compose([*overrides, f"+sandbox.images.python={hf_checkpoint}"], config_name=config_name)),
                 world_size=1)
    else:
        validate(cfg, world_size=1)

    assert isinstance(cfg, TrainConfig)
    composed = OmegaConf.structured(cfg)
    for key, value in leaves.items():
        if isinstance(value, str) and ("${" in value or value == "???"):
            continue
        if key in _leaves(TINY_PRESET) and package and yaml_path.parent.name != "model":
            continue  # a group option's value that the default (tiny) model's preset replaces on purpose
        if key == "rollout.backend" and value == "auto":
            assert cfg.rollout.backend in ("hf", "sglang")  # resolved when typed
            continue
        if key in DEVICE_DEFAULTS and value is None:
            assert OmegaConf.select(composed, key) in (True, False)  # resolved when typed
            continue
        # Every value the file writes must survive composition (nothing silently dropped).
        assert OmegaConf.select(composed, key) == value, f"{yaml_path.name}: {key}"


@pytest.mark.parametrize("yaml_path", [p for p in ALL_YAMLS if p.parent.name in SCHEMAS], ids=lambda p: p.name)
def test_every_group_option_names_its_schema(yaml_path: Path) -> None:
    defaults = OmegaConf.load(yaml_path).get("defaults", [])
    assert f"base_{yaml_path.parent.name}" in defaults, "list the schema first so typos in the file are caught"


def test_schemas_are_registered() -> None:
    repo = ConfigStore.instance().repo
    assert "base_config.yaml" in repo
    for group in SCHEMAS:
        assert f"base_{group}.yaml" in repo[group]


def test_overrides_apply() -> None:
    cfg = load_config(["parallel.tp=2", "optimizer.lr=1e-6"], world_size=2)
    assert cfg.parallel.tp == 2
    assert cfg.optimizer.lr == 1e-6
    assert cfg.parallel.dp_size(2) == 1
    assert cfg.model.name == "tiny_qwen2" and cfg.model.path is None


def test_defaults_and_run_dir_resolved() -> None:
    cfg = load_config([], world_size=1)
    # The YAML defaults agree with the dataclass defaults, but for what the default (tiny) model's preset sets
    preset = OmegaConf.load(CONF_DIR / "preset" / "tiny.yaml")
    expected = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig(run_dir=cfg.run_dir)), preset))
    assert cfg == expected
    assert cfg.run_dir.startswith("runs/") and "${" not in cfg.run_dir


def test_experiment_selects_and_overrides() -> None:
    import yaml

    from megatron_rl.config import CONF_DIR

    written = yaml.safe_load((CONF_DIR / "experiment" / "demo_countdown.yaml").read_text())
    cfg = load_config(["+experiment=demo_countdown"], world_size=1)
    assert cfg.mode == "rl"
    assert cfg.task.type == "countdown"
    assert cfg.optimizer.lr == written["optimizer"]["lr"] != TrainConfig().optimizer.lr
    assert cfg.task.sft_warmup_steps == written["task"]["sft_warmup_steps"]


def test_checkpoint_model_takes_user_path(hf_checkpoint: Path) -> None:
    cfg = load_config(["model=qwen2_5_7b", f"model.path={hf_checkpoint}", "parallel.tp=4"], world_size=8)
    assert cfg.model.path == str(hf_checkpoint)
    assert cfg.model.tokenizer == str(hf_checkpoint)
    assert cfg.model.num_attention_heads == 28 and cfg.model.num_query_groups == 4
    assert cfg.model.resolved_qkv_bias and cfg.model.resolved_head_dim == 128


@pytest.mark.parametrize(
    ("option", "qkv_bias", "qk_layernorm", "head_dim", "tied"),
    [
        ("tiny_qwen2", True, False, 32, True),
        ("tiny_llama", False, False, 32, False),
        ("tiny_qwen3", False, True, 32, True),
        ("tiny_qwen3_moe", False, True, 32, True),
        ("tiny_mixtral", False, False, 32, False),
        ("tiny_qwen2_moe", True, False, 32, False),
        ("tiny_glm4_moe", True, False, 32, False),
        ("tiny_deepseek_v3", False, False, 24, False),  # MLA: the query/key width, 16 + 8
        ("tiny_deepseek_v2", False, False, 24, False),
    ],
)
def test_family_defaults(option: str, qkv_bias: bool, qk_layernorm: bool, head_dim: int, tied: bool) -> None:
    model = load_config([f"model={option}"], world_size=1).model
    assert model.resolved_qkv_bias is qkv_bias
    assert model.resolved_qk_layernorm is qk_layernorm
    assert model.resolved_head_dim == head_dim
    assert model.tie_word_embeddings is tied


def test_expert_parallel_layouts() -> None:
    cfg = load_config(["model=tiny_qwen3_moe", "parallel.ep=2"], world_size=2)
    assert cfg.parallel.ep == 2 and cfg.model.is_moe and cfg.model.num_experts == 4
    # experts split over the data-parallel ranks of each (tp, pp) position: tp*ep*pp divides the world
    load_config(["model=tiny_qwen3_moe", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2",
                 "global_batch_size=8"], world_size=4)
    assert not ModelConfig().is_moe


def test_deepseek_v3_configs_compose() -> None:
    """The real-size configs: DeepSeek-V3's YaRN and groups, Moonlight's uncompressed queries."""
    v3 = load_config(["model=deepseek_v3", "model.path=null", "model.tokenizer=builtin:char", "parallel.tp=8",
                      "parallel.sequence_parallel=true", "parallel.ep=8"], world_size=64).model
    assert v3.multi_latent_attention and v3.resolved_head_dim == 192 and v3.rope_scaling_factor == 40
    assert (v3.moe_router_num_groups, v3.moe_router_group_topk, v3.moe_dense_layers) == (8, 4, [0, 1, 2])
    moonlight = load_config(["model=moonlight_16b_a3b", "model.path=null", "model.tokenizer=builtin:char"],
                            world_size=1).model
    assert moonlight.q_lora_rank is None and moonlight.rope_scaling_factor is None
    lite = load_config(["model=deepseek_v2_lite", "model.path=null", "model.tokenizer=builtin:char"],
                       world_size=1).model
    assert (lite.family, lite.q_lora_rank, lite.rope_scaling_mscale, lite.moe_norm_topk_prob) == (
        "deepseek_v2", None, 0.707, False)


def test_resolved_fields_follow_family_when_unset() -> None:
    assert ModelConfig(family="qwen2").resolved_qkv_bias is True
    assert ModelConfig(family="llama").resolved_qkv_bias is False
    assert ModelConfig(family="qwen3").resolved_qk_layernorm is True
    assert ModelConfig(family="qwen3", qk_layernorm=False).resolved_qk_layernorm is False
    assert ModelConfig(hidden_size=128, num_attention_heads=4, head_dim=None).resolved_head_dim == 32


def test_sequence_level_rollout_correction_is_refused_with_context_parallelism() -> None:
    from megatron_rl.config.checks.run import check_run

    for option in ("algorithm.rollout_is=sequence", "algorithm.rollout_mask=geometric"):
        with pytest.raises(ConfigError, match=f"{option} weighs whole sequences"):
            load_config(["mode=rl", "cluster.nproc=2", "parallel.cp=2", option], world_size=2)
        check_run(load_config(["mode=rl", option], world_size=1))


def test_routing_replay_is_refused_where_it_cannot_work() -> None:
    from megatron_rl.config.checks.run import check_run

    moe = ["mode=rl", "model=tiny_qwen3_moe"]
    old, rollout = [*moe, "algorithm.routing_replay=old"], [*moe, "algorithm.routing_replay=rollout"]
    check_run(load_config(old, world_size=1))
    check_run(load_config(rollout, world_size=1))
    check_run(load_config([*rollout, "algorithm.old_logprobs=rollout"], world_size=1))
    check_run(load_config([*old, "model.recompute=full"], world_size=1))  # one stage: the same micro-batch
    check_run(load_config([*rollout, "rollout.mode=disaggregated"], world_size=1))
    check_run(load_config([*rollout, "rollout.mode=disaggregated", "rollout.partial_rollout_tokens=2"],
                                   world_size=1))  # each position keeps the routing of its chunk's call
    check_run(load_config([*rollout, "task.type=agent", "task.max_episode_tokens=500"], world_size=1))
    refused = {
        "has no experts": (["mode=rl", "algorithm.routing_replay=old"], 1),
        "algorithm.old_logprobs=rollout skips": ([*old, "algorithm.old_logprobs=rollout"], 1),
        "1F1B schedule recomputes": ([*old, "model.recompute=full", "cluster.nproc=2", "parallel.pp=2"], 2),
    }
    for message, (overrides, world) in refused.items():
        with pytest.raises(ConfigError, match=message):
            check_run(load_config(overrides, world_size=world))
    with pytest.raises(ValueError, match="algorithm.routing_replay"):
        load_config([*moe, "algorithm.routing_replay=true"], world_size=1)


def test_lora_settings_are_checked() -> None:
    cfg = load_config(["model.lora_rank=8", "model.lora_targets=[linear_qkv,linear_fc2]"], world_size=1)
    assert cfg.model.lora_rank == 8 and cfg.model.lora_targets == ["linear_qkv", "linear_fc2"]
    load_config(["model=tiny_deepseek_v3", "model.lora_rank=4", "model.lora_targets=[linear_proj,linear_fc1]"],
                world_size=1)  # its layer 0 is dense
    load_config(["model=tiny_qwen3_moe", "model.lora_rank=4", "model.lora_targets=[linear_qkv,linear_proj]"],
                world_size=1)
    cfg = load_config(["model=tiny_qwen3_moe", "model.lora_rank=4",
                       "model.lora_targets=[linear_proj,experts.linear_fc1,experts.linear_fc2]"], world_size=1)
    assert cfg.model.expert_lora_targets == ["experts.linear_fc1", "experts.linear_fc2"]
    cfg = load_config(["model=tiny_glm4_moe", "model.lora_rank=4",
                       "model.lora_targets=[linear_fc1,shared_experts.linear_fc1,shared_experts.linear_fc2]"],
                      world_size=1)  # layer 0 is dense
    assert cfg.model.expert_lora_targets == ["shared_experts.linear_fc1", "shared_experts.linear_fc2"]
    refused = {
        "model.lora_rank": ["model.lora_rank=-1"],
        "model.lora_alpha": ["model.lora_rank=4", "model.lora_alpha=0"],
        "allowed values are linear_qkv": ["model.lora_rank=4", "model.lora_targets=[q_proj]"],
        "lists a layer twice": ["model.lora_rank=4", "model.lora_targets=[linear_qkv,linear_qkv]"],
        "name at least one": ["model.lora_rank=4", "model.lora_targets=[]"],
        "has no linear_qkv": ["model=tiny_deepseek_v3", "model.lora_rank=4"],
        "every layer of this model has experts": ["model=tiny_qwen3_moe", "model.lora_rank=4"],
        "has no experts; leave experts.linear_fc2 out": ["model.lora_rank=4",
                                                         "model.lora_targets=[experts.linear_fc2]"],
        "has no shared experts": ["model=tiny_qwen3_moe", "model.lora_rank=4",
                                  "model.lora_targets=[linear_qkv,shared_experts.linear_fc1]"],
    }
    for message, overrides in refused.items():
        with pytest.raises(ValueError, match=message):
            load_config(overrides, world_size=1)


def test_adapter_sync_needs_lora() -> None:
    for mode in ("colocated", "disaggregated"):
        cfg = load_config(["mode=rl", "model.lora_rank=4", "rollout.weight_sync=adapters", f"rollout.mode={mode}"],
                          world_size=1)
        assert cfg.rollout.weight_sync == "adapters"
    refused = {
        "rollout.weight_sync=adapters is invalid: the model trains no LoRA adapters": ["rollout.weight_sync=adapters"],
        "allowed values are full, adapters": ["model.lora_rank=4", "rollout.weight_sync=lora"],
        "moves it every step": ["model=tiny_glm4_moe", "model.lora_rank=4", "model.lora_targets=[linear_qkv]",
                                "model.moe_router_bias_update_rate=0.001", "rollout.weight_sync=adapters"],
        "engines get adapters on experts merged only": ["model=tiny_qwen3_moe", "model.lora_rank=4",
                                                        "model.lora_targets=[experts.linear_fc1]",
                                                        "rollout.weight_sync=adapters"],
    }
    for message, overrides in refused.items():
        with pytest.raises(ValueError, match=message):
            load_config(["mode=rl", *overrides], world_size=1)


def test_critic_free_gae_runs_with_one_sample_per_prompt() -> None:
    from megatron_rl.config.checks.run import check_run

    cfg = load_config(["mode=rl", "algorithm=ppo", "rollout.n_samples_per_prompt=1", "global_batch_size=4"],
                      world_size=1)
    check_run(cfg)
    assert cfg.algorithm.advantage_estimator == "gae" and cfg.algorithm.gae_gamma == 1.0


def test_dp_size() -> None:
    assert ParallelConfig(tp=2, pp=2).dp_size(8) == 2
    with pytest.raises(ValueError, match="world_size=6"):
        ParallelConfig(tp=4).dp_size(6)


INVALID_CASES = [
    # (overrides, world_size, substrings the message must contain)
    (["optimizer.lrr=1"], 1, ["optimizer.lrr", "optimizer.lrr=1", "lr"]),
    (["+optimizer.lrr=1"], 1, ["optimizer.lrr", "+optimizer.lrr=1"]),
    (["foo=1"], 1, ["foo=1", "global_batch_size"]),
    (["optimizer.lr=abc"], 1, ["optimizer.lr", "abc", "float"]),
    (["parallel.tp=3"], 3, ["parallel.tp=3", "model.num_attention_heads=4", "valid parallel.tp values", "are 1"]),
    (["parallel.tp=3"], 4, ["parallel.tp=3", "world_size=4", "valid parallel.tp values", "are 1, 2"]),
    (["optimizer.lr=-1"], 1, ["optimizer.lr=-1", "> 0"]),
    (["optimizer.lr=1e-4", "optimizer.min_lr=1e-3"], 1, ["optimizer.min_lr=0.001", "optimizer.lr=0.0001"]),
    (["model=qwen2_5_7b"], 1, ["model.path", "???"]),
    (["model.path=/nonexistent/ckpt"], 1, ["model.path=/nonexistent/ckpt", "does not exist", "config.json"]),
    (["model.tokenizer=/nonexistent/tok"], 1, ["model.tokenizer=/nonexistent/tok", "does not exist"]),
    (["rollout.top_p=0"], 1, ["rollout.top_p=0", "(0, 1]"]),
    (["model=nope"], 1, ["model=nope", "tiny_qwen2", "qwen2_5_7b"]),
    (["+experiment=nope"], 1, ["experiment=nope", "demo_countdown"]),
    (["parallel.sequence_parallel=true"], 1, ["parallel.sequence_parallel=true", "parallel.tp=1"]),
    (["parallel.use_distributed_optimizer=false", "parallel.overlap_param_gather=true"], 2,
     ["parallel.overlap_param_gather=true", "parallel.use_distributed_optimizer=false",
      "set parallel.use_distributed_optimizer=true or parallel.overlap_param_gather=false"]),
    (["cluster.device=cpu", "parallel.overlap_param_gather=true"], 2,
     ["parallel.overlap_param_gather=true", "parallel.use_distributed_optimizer=null, which is off on CPU"]),
    (["sandbox.runtime=process"], 1, ["sandbox.runtime=process", "sandbox.allow_unisolated=true"]),
    (["model.family=gpt"], 1, ["model.family=gpt", "llama, qwen2, qwen3"]),
    (["model.num_query_groups=3"], 1, ["model.num_query_groups=3", "model.num_attention_heads=4"]),
    (["parallel.pp=3"], 3, ["model.num_layers=4", "parallel.pp=3"]),
    (["global_batch_size=3"], 2, ["global_batch_size=3", "data-parallel size 2"]),
    (["rollout.tp=3"], 4, ["rollout.tp=3", "world_size=4"]),
    (["task.type=dataset"], 1, ["task.path=null", "task.type=dataset"]),
    (["task.type=dataset", "task.path=/nonexistent.jsonl"], 1, ["task.path=/nonexistent.jsonl", "does not exist"]),
    (["task.type=dataset", "task.path=/etc/hostname"], 1, ["task.path=/etc/hostname", "cannot tell the format"]),
    (["task.type=arithmetic", "task.reward=tests"], 1, ["task.reward=tests", "allows auto, math, exact"]),
    (["task.type=countdown", "task.reward=math"], 1, ["task.reward=math", "allows auto, countdown"]),
    (["algorithm.overlong=penalty"], 1, ["algorithm.overlong_penalty_window=0", "must be >= 1"]),
    (["algorithm.overlong=drop"], 1, ["algorithm.overlong=drop", "none, filter, penalty"]),
    (["mode=rl", "rollout.n_samples_per_prompt=1"], 1, ["rollout.n_samples_per_prompt=1", "grpo"]),
    (["mode=rl", "algorithm.advantage_estimator=reinforce_pp", "rollout.n_samples_per_prompt=1"], 1,
     ["rollout.n_samples_per_prompt=1", "reinforce_pp", "all advantages would be 0"]),
    (["algorithm.gae_gamma=1.5"], 1, ["algorithm.gae_gamma=1.5", "[0, 1]"]),
    (["algorithm.rollout_mask=seq"], 1, ["algorithm.rollout_mask=seq", "geometric"]),
    (["task.eval_temperature=-0.5"], 1, ["task.eval_temperature=-0.5", ">= 0"]),
    (["rollout.temperature=-1"], 1, ["rollout.temperature=-1", ">= 0"]),
    (["algorithm=gspo", "algorithm.eps_clip_c=3"], 1, ["algorithm.eps_clip_c=3", "not gspo"]),
    (["rollout.stop=['']"], 1, ["rollout.stop=['']", "non-empty"]),
    (["algorithm.ref_update_every=5"], 1, ["algorithm.ref_update_every=5", "kl_coef > 0"]),
    (["algorithm.kl_in_reward=true"], 1, ["algorithm.kl_in_reward=true", "kl_coef > 0"]),
    (["checkpoint.keep_best=1"], 1, ["checkpoint.keep_best=1", "checkpoint.save_every >= 1"]),
    (["mode=rl", "checkpoint.keep_best=1", "checkpoint.save_every=3", "task.eval_every=2"], 1,
     ["checkpoint.save_every=3", "multiple of task.eval_every=2"]),
    (["checkpoint.best_mode=high"], 1, ["checkpoint.best_mode=high", "max, min"]),
    (["mode=sft", "checkpoint.keep_best=1", "checkpoint.save_every=5"], 1,
     ["checkpoint.best_metric=eval/accuracy", "best_metric=loss"]),
    (["algorithm.kl_coef=0.1", "algorithm.kl_target=0.01"], 1, ["algorithm.kl_target=0.01", "kl_in_reward=true"]),
    (["algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true", "algorithm.kl_target=0"], 1,
     ["algorithm.kl_target=0", "> 0"]),
    (["algorithm.critic=true"], 1, ["algorithm.critic=true", "advantage_estimator=gae", "not grpo"]),
    (["algorithm=ppo", "algorithm.critic_warmup_steps=2"], 1,
     ["algorithm.critic_warmup_steps=2", "algorithm.critic=true"]),
    (["algorithm=ppo", "algorithm.critic=true", "algorithm.critic_warmup_steps=5", "num_steps=5"], 1,
     ["algorithm.critic_warmup_steps=5", "num_steps=5"]),
    (["algorithm=ppo", "algorithm.critic=true", "algorithm.value_clip=0"], 1, ["algorithm.value_clip=0", "> 0"]),
    (["mode=rl", "algorithm=ppo", "rollout.n_samples_per_prompt=1", "algorithm.filter_zero_variance=true"], 1,
     ["algorithm.filter_zero_variance=true", "rollout.n_samples_per_prompt=1", "every sample would be dropped"]),
    (["mode=rl", "task.eval_max_new_tokens=100000"], 1, ["task.eval_max_new_tokens=100000",
                                                        "model.max_position_embeddings"]),
    (["algorithm.rollout_mask_low=1.2"], 1, ["algorithm.rollout_mask_low=1.2", "(0, 1)"]),
    (["rollout=sglang", "rollout.top_k=1", "rollout.temperature=0.7"], 1,
     ["rollout.top_k=1", "rollout.temperature=0.7", "set rollout.temperature=1"]),
    (["parallel.tp=0"], 1, ["parallel.tp=0", ">= 1"]),
    (["cluster.master_port=70000"], 1, ["cluster.master_port=70000", "65535"]),
    (["optimizer.lr=="], 1, ["optimizer.lr=="]),
    (["parallel.ep=2"], 2, ["parallel.ep=2", "dense", "model.num_experts"]),
    (["parallel.ep=0"], 1, ["parallel.ep=0", ">= 1"]),
    (["model.num_experts=4", "model.moe_ffn_hidden_size=64"], 1, ["model.num_experts=4", "qwen3_moe"]),
    (["model=tiny_qwen3_moe", "model.num_experts=null"], 1, ["model.num_experts=null", "qwen3_moe"]),
    (["model=tiny_qwen3_moe", "model.moe_ffn_hidden_size=null"], 1, ["model.moe_ffn_hidden_size=null"]),
    (["model=tiny_qwen3_moe", "model.moe_router_topk=5"], 1, ["model.moe_router_topk=5", "model.num_experts=4"]),
    (["model=tiny_qwen3_moe", "model.moe_router_topk=1"], 1, ["model.moe_router_topk=1", "moe_norm_topk_prob"]),
    (["model=tiny_qwen3_moe", "parallel.ep=3"], 3, ["parallel.ep=3", "model.num_experts=4", "1, 2, 4"]),
    (["model=tiny_qwen3_moe", "parallel.ep=2", "parallel.pp=2"], 2,
     ["parallel.ep=2", "world_size=2", "valid parallel.ep values are 1"]),
    (["model=tiny_qwen3_moe", "parallel.tp=2"], 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (["model=tiny_mixtral", "model.num_experts=null"], 1, ["model.num_experts=null", "mixtral"]),
    (["model=tiny_mixtral", "model.qkv_bias=true"], 1, ["model.qkv_bias=true", "Mixtral attention"]),
    (["model=tiny_mixtral", "model.qk_layernorm=true"], 1, ["model.qk_layernorm=true", "Mixtral attention"]),
    (["model=tiny_mixtral", "model.moe_norm_topk_prob=false"], 1,
     ["model.moe_norm_topk_prob=false", "set model.moe_norm_topk_prob=true"]),
    (["model=tiny_mixtral", "model.ffn_hidden_size=352"], 1,
     ["model.ffn_hidden_size=352", "model.ffn_hidden_size=64"]),
    (["model=tiny_mixtral", "model.moe_router_topk=1"], 1, ["model.moe_router_topk=1", "topk >= 2"]),
    (["model=tiny_mixtral", "parallel.ep=3"], 3, ["parallel.ep=3", "model.num_experts=4", "1, 2, 4"]),
    (["model=tiny_qwen2_moe", "model.moe_shared_expert_intermediate_size=null"], 1,
     ["model.moe_shared_expert_intermediate_size=null", "HF shared_expert_intermediate_size"]),
    (["model=tiny_qwen2_moe", "model.moe_shared_expert_intermediate_size=0"], 1,
     ["model.moe_shared_expert_intermediate_size=0", "must be >= 1"]),
    (["model=tiny_qwen2_moe", "model.qkv_bias=false"], 1, ["model.qkv_bias=false", "Qwen2-MoE attention"]),
    (["model=tiny_qwen2_moe", "model.qk_layernorm=true"], 1, ["model.qk_layernorm=true", "Qwen2-MoE attention"]),
    (["model=tiny_qwen2_moe", "model.num_experts=null"], 1,
     ["model.num_experts=null", "qwen2_moe is a mixture of experts"]),
    (["model=tiny_qwen2_moe", "parallel.tp=2"], 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (["model=tiny_qwen3_moe", "model.moe_shared_expert_intermediate_size=64"], 1,
     ["model.moe_shared_expert_intermediate_size=64", "qwen3_moe has no shared expert"]),
    (["model.moe_shared_expert_intermediate_size=64"], 1,
     ["model.moe_shared_expert_intermediate_size=64", "only applies with model.num_experts"]),
    (["model.moe_dense_layers=[1]"], 1, ["model.moe_dense_layers=[1]", "only applies with model.num_experts"]),
    (["model=tiny_qwen3_moe", "model.moe_dense_layers=[4]"], 1,
     ["model.moe_dense_layers=[4]", "layer(s) [4] outside [0, model.num_layers=4)"]),
    (["model=tiny_qwen3_moe", "model.moe_dense_layers=[1,1]"], 1, ["model.moe_dense_layers=[1, 1]", "twice"]),
    (["model=tiny_qwen3_moe", "model.moe_dense_layers=[0,1,2,3]"], 1,
     ["model.moe_dense_layers=[0, 1, 2, 3]", "every layer dense"]),
    (["model=tiny_glm4_moe", "model.rope_scaling_factor=8"], 1, ["model.rope_scaling_factor=8", "plain RoPE"]),
    (["model=tiny_mixtral", "model.moe_dense_layers=[1]"], 1, ["model.moe_dense_layers=[1]", "Mixtral"]),
    (["model.rotary_percent=0.5"], 1, ["model.rotary_percent=0.5", "only model.family=glm4_moe rotates part"]),
    (["model=tiny_qwen3_moe", "model.moe_routed_scaling_factor=2"], 1,
     ["model.moe_routed_scaling_factor=2", "only the routers of model.family=glm4_moe, deepseek_v2, deepseek_v3"]),
    (["model=tiny_deepseek_v3", "model.rotary_percent=0.5"], 1,
     ["model.rotary_percent=0.5", "set model.rotary_percent=1"]),
    (["model.kv_lora_rank=16"], 1,
     ["model.kv_lora_rank=16", "only model.family=deepseek_v2 or deepseek_v3", "set model.kv_lora_rank=null"]),
    (["model=tiny_deepseek_v3", "model.kv_lora_rank=null"], 1, ["model.kv_lora_rank=null", "deepseek_v3 needs it"]),
    (["model=tiny_deepseek_v3", "model.qk_rope_head_dim=7"], 1, ["model.qk_rope_head_dim=7", "must be even"]),
    (["model=tiny_deepseek_v3", "model.num_query_groups=2"], 1,
     ["model.num_query_groups=2", "set it to model.num_attention_heads=4"]),
    (["model=tiny_deepseek_v3", "model.qkv_bias=true"], 1, ["model.qkv_bias=true", "multi-latent attention"]),
    (["model=tiny_deepseek_v3", "model.head_dim=32"], 1, ["model.head_dim=32", "qk_*/v_head_dim"]),
    (["model=tiny_deepseek_v3", "model.moe_dense_layers=[2]"], 1,
     ["model.moe_dense_layers=[2]", "DeepSeek-V3 has its dense layers first"]),
    (["model=tiny_deepseek_v3", "model.moe_shared_expert_intermediate_size=null"], 1,
     ["model.moe_shared_expert_intermediate_size=null", "DeepSeek-V3 layers have n_shared_experts"]),
    (["model=tiny_deepseek_v3", "model.rope_scaling_factor=8", "model.rope_scaling_high_freq_factor=8"], 1,
     ["model.rope_scaling_high_freq_factor=8", "Llama 3.1 scaling parameter", "YaRN"]),
    (["model=tiny_deepseek_v3", "model.rope_scaling_beta_fast=16"], 1,
     ["model.rope_scaling_beta_fast=16", "only applies with YaRN scaling"]),
    (["model=tiny_deepseek_v3", "model.rope_scaling_factor=8", "model.rope_scaling_beta_slow=40"], 1,
     ["model.rope_scaling_beta_slow=40", "must not exceed model.rope_scaling_beta_fast=32"]),
    (["model=tiny_deepseek_v3", "model.rope_scaling_factor=8", "model.rope_scaling_mscale=0.7"], 1,
     ["model.rope_scaling_mscale=0.7", "both > 0"]),
    (["model.rope_scaling_type=ntk"], 1, ["model.rope_scaling_type=ntk", "llama3", "yarn"]),
    (["model=tiny_deepseek_v3", "model.rope_scaling_type=llama3"], 1,
     ["model.rope_scaling_type=llama3", "deepseek_v3 scales RoPE with YaRN only"]),
    (["model=tiny_glm4_moe", "model.rope_scaling_type=yarn"], 1,
     ["model.rope_scaling_type=yarn", "model.family=glm4_moe has no YaRN scaling here"]),
    (["model.rope_scaling_type=yarn", "model.rope_scaling_factor=4", "model.rope_scaling_low_freq_factor=2"], 1,
     ["model.rope_scaling_low_freq_factor=2", "Llama 3.1 scaling parameter"]),
    (["model.rope_scaling_type=yarn", "model.rope_scaling_factor=4", "model.rope_scaling_beta_slow=40"], 1,
     ["model.rope_scaling_beta_slow=40", "must not exceed model.rope_scaling_beta_fast=32"]),
    (["model.rope_scaling_mscale_all_dim=1"], 1, ["model.rope_scaling_mscale_all_dim=1", "only YaRN scaling"]),
    (["model.rope_scaling_truncate=false"], 1, ["model.rope_scaling_truncate=false", "only YaRN scaling"]),
    (["model=tiny_deepseek_v3", "model.rope_scaling_factor=4.0", "model.rope_scaling_truncate=false"], 1,
     ["model.rope_scaling_truncate=false", "always rounds"]),
    (["model.sliding_window=16"], 1, ["model.sliding_window=16", "only model.family=gpt_oss"]),
    (["model=tiny_mixtral", "model.moe_router_bias_update_rate=0.001"], 1,
     ["model.moe_router_bias_update_rate=0.001", "only the sigmoid routers"]),
    (["model=tiny_deepseek_v3", "model.moe_router_bias_update_rate=-1"], 1,
     ["model.moe_router_bias_update_rate=-1", ">= 0"]),
    (["model.swiglu_limit=7.0"], 1, ["model.swiglu_limit=7", "only model.family=gpt_oss"]),
    (["model=tiny_gpt_oss", "model.swiglu_limit=null"], 1, ["model.swiglu_limit=null", "clamps"]),
    (["model=tiny_gpt_oss", "model.sliding_window=null"], 1, ["model.sliding_window_layers=[0, 2]",
                                                              "needs model.sliding_window"]),
    (["model=tiny_gpt_oss", "model.sliding_window_layers=[0,4]"], 1, ["model.sliding_window_layers=[0, 4]",
                                                                       "outside [0, model.num_layers=4)"]),
    (["model=tiny_gpt_oss", "model.qkv_bias=false"], 1, ["model.qkv_bias=false", "bias on every linear layer"]),
    (["model=tiny_gpt_oss", "model.moe_dense_layers=[0]"], 1, ["model.moe_dense_layers=[0]", "gpt-oss"]),
    (["model=tiny_gpt_oss", "parallel.cp=2"], 2, ["parallel.cp=2", "model.family=gpt_oss"]),
    (["model=tiny_gpt_oss", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=2"], 2,
     ["parallel.etp=2", "Megatron-core supports only with expert tensor-parallel size 1"]),
    (["parallel.tp=2", "parallel.etp=3"], 2, ["parallel.etp=3", "must be 1 or parallel.tp=2"]),
    (["parallel.tp=2", "parallel.etp=1"], 2, ["parallel.etp=1", "dense model"]),
    (["model=tiny_deepseek_v2", "model.moe_norm_topk_prob=true"], 1,
     ["model.moe_norm_topk_prob=true", "DeepSeek-V2 keeps the top-k softmax weights"]),
    (["model=tiny_deepseek_v2", "model.moe_router_topk=4"], 1,
     ["model.moe_router_group_topk=2", "top 1 scores", "= 2"]),
    (["model=tiny_deepseek_v2", "model.moe_dense_layers=[1]"], 1,
     ["model.moe_dense_layers=[1]", "DeepSeek-V2 has its dense layers first"]),
    (["model=tiny_glm4_moe", "model.rotary_percent=0"], 1, ["model.rotary_percent=0", "(0, 1]"]),
    (["model=tiny_glm4_moe", "model.rotary_percent=0.3"], 1, ["model.rotary_percent=0.3", "even number", "9.6"]),
    (["model=tiny_glm4_moe", "model.moe_shared_expert_intermediate_size=96"], 1,
     ["model.moe_shared_expert_intermediate_size=96", "multiple of model.moe_ffn_hidden_size=64"]),
    (["model=tiny_glm4_moe", "model.moe_dense_layers=[1]"], 1, ["model.moe_dense_layers=[1]", "dense layers first"]),
    (["model=tiny_glm4_moe", "model.moe_norm_topk_prob=false"], 1,
     ["model.moe_norm_topk_prob=false", "sigmoid router renormalises"]),
    (["model=tiny_glm4_moe", "model.moe_router_num_groups=3"], 1,
     ["model.moe_router_num_groups=3", "must divide model.num_experts=4", "1, 2, 4"]),
    (["model=tiny_glm4_moe", "model.moe_router_num_groups=2", "model.moe_router_group_topk=2"], 1,
     ["model.moe_router_group_topk=2", "top 2 scores", "= 1"]),
    (["model=tiny_glm4_moe", "model.moe_router_num_groups=2", "model.moe_router_group_topk=3"], 1,
     ["model.moe_router_group_topk=3", "[1, model.moe_router_num_groups=2]"]),
    (["model.rope_scaling_factor=0.5"], 1, ["model.rope_scaling_factor=0.5", ">= 1"]),
    (["model.rope_scaling_factor=8", "model.rope_scaling_low_freq_factor=2"], 1,
     ["model.rope_scaling_low_freq_factor=2", "low_freq_factor=1 fixed", "only 1 is supported"]),
    (["model.rope_scaling_factor=8", "model.rope_scaling_high_freq_factor=8"], 1,
     ["model.rope_scaling_high_freq_factor=8", "high_freq_factor=4 fixed"]),
    (["model.rope_scaling_factor=8", "model.rope_scaling_original_max_position_embeddings=4096"], 1,
     ["model.rope_scaling_original_max_position_embeddings=4096", "only 8192 is supported"]),
    (["model.rope_scaling_high_freq_factor=8"], 1,
     ["model.rope_scaling_high_freq_factor=8", "only applies with Llama 3.1 rope scaling"]),
]


@pytest.mark.parametrize(("overrides", "world_size", "expected"), INVALID_CASES, ids=lambda v: str(v))
def test_invalid_config_raises_one_line_error(overrides: list[str], world_size: int, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, world_size=world_size)
    message = str(info.value)
    assert "\n" not in message
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_unknown_group_option_lists_options_not_schemas() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(["model=nope"], world_size=1)
    assert "base_model" not in str(info.value)


def test_model_path_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.path=.*has no config.json") as info:
        load_config([f"model.path={tmp_path}"], world_size=1)
    assert str(tmp_path) in str(info.value)


def _refused(ckpt: Path, *extra: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(["model=qwen2_5_7b", f"model.path={ckpt}", "parallel.tp=4", *extra], world_size=8)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_model_path_without_weights_is_refused_at_config_time(hf_checkpoint: Path) -> None:
    (hf_checkpoint / "model.safetensors").unlink()
    assert _refused(hf_checkpoint) == (f"model.path={hf_checkpoint}: {hf_checkpoint}: no model.safetensors or "
                                       "model.safetensors.index.json")


def test_model_path_with_a_missing_or_truncated_shard_is_refused_naming_it(hf_checkpoint: Path) -> None:
    shard = _shard(hf_checkpoint, "model-00001-of-00001.safetensors")
    data = shard.read_bytes()  # 8-byte length, JSON header, 3 + 5 float32 = 32 bytes of data
    assert len(data) == 8 + int.from_bytes(data[:8], "little") + 32
    shard.write_bytes(data[:-4])
    assert _refused(hf_checkpoint) == (f"model.path={hf_checkpoint}: {shard}: shard listed in "
                                       f"{hf_checkpoint / 'model.safetensors.index.json'} is truncated: "
                                       f"{len(data) - 4} bytes, its header declares {len(data)}")
    shard.unlink()
    assert _refused(hf_checkpoint).endswith(f"{shard}: shard listed in "
                                            f"{hf_checkpoint / 'model.safetensors.index.json'} is missing")


def test_model_path_with_a_zeroed_single_file_is_refused_naming_it(hf_checkpoint: Path) -> None:
    weights = hf_checkpoint / "model.safetensors"
    weights.write_bytes(bytes(weights.stat().st_size))
    assert f"{weights}: not safetensors (zeroed or overwritten?)" in _refused(hf_checkpoint)


def test_tokenizer_directory_without_tokenizer_files_is_refused(hf_checkpoint: Path) -> None:
    (hf_checkpoint / "tokenizer.json").write_text('{"model": ')  # a copy cut short
    assert _refused(hf_checkpoint).startswith(f"model.tokenizer={hf_checkpoint}: {hf_checkpoint / 'tokenizer.json'} "
                                              "is unreadable (JSONDecodeError")
    (hf_checkpoint / "tokenizer.json").unlink()
    assert _refused(hf_checkpoint).startswith(f"model.tokenizer={hf_checkpoint}: {hf_checkpoint} holds no tokenizer "
                                              "files (none of tokenizer.json, *.model")
    (hf_checkpoint / "tokenizer.model").write_bytes(b"sentencepiece")  # a SentencePiece vocabulary will do
    load_config(["model=qwen2_5_7b", f"model.path={hf_checkpoint}", "parallel.tp=4"], world_size=8)


def test_unisolated_sandbox_needs_explicit_opt_in() -> None:
    cfg = load_config(["sandbox.runtime=process", "sandbox.allow_unisolated=true"], world_size=1)
    assert cfg.sandbox.runtime == "process"


def test_checkpoint_model_with_null_path_is_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(["model=qwen2_5_7b", "model.path=null"], world_size=1)
    assert "model.tokenizer=${model.path}" in str(info.value) and "\n" not in str(info.value)


@pytest.fixture
def conf_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of conf/ that the loader reads instead of the repository's."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    monkeypatch.setattr(loader, "CONF_DIR", conf)
    return conf


def test_typo_in_yaml_file_is_caught(conf_copy: Path) -> None:
    adam = conf_copy / "optimizer" / "adam.yaml"
    adam.write_text(adam.read_text() + "lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key optimizer.lrr \(in a config file\)"):
        load_config([], world_size=1)


def test_bad_default_in_yaml_file_names_the_file(conf_copy: Path) -> None:
    adam = conf_copy / "optimizer" / "adam.yaml"
    adam.write_text(adam.read_text().replace("- base_optimizer", "- base_optimzer"))
    with pytest.raises(ConfigError, match=r"In 'optimizer/adam'.*base_optimzer.*schema is base_optimizer"):
        load_config([], world_size=1)


def test_to_typed_rejects_keys_added_with_plus() -> None:
    cfg = compose([])
    OmegaConf.update(cfg, "optimizer.lrr", 1.0, force_add=True)  # what "+optimizer.lrr=1" does in @hydra.main
    with pytest.raises(ConfigError, match="unknown key optimizer.lrr"):
        to_typed(cfg)


def test_model_option_must_state_path(conf_copy: Path) -> None:
    # A model file without `path:` must not silently fall back to random init.
    (conf_copy / "model" / "custom.yaml").write_text("defaults:\n  - base_model\n  - _self_\nname: custom\n")
    with pytest.raises(ConfigError, match=r"model.path=\?\?\? is required"):
        load_config(["model=custom"], world_size=1)


def test_loader_is_light() -> None:
    """Configs are checked before any work starts (the Slurm batch step checks one before it starts any srun
    step): loading a config must not import torch, Megatron or transformers. Its time is not asserted (a 2 s
    bound failed once on a loaded CI machine)."""
    code = textwrap.dedent(
        """
        import sys
        from megatron_rl.config import load_config
        load_config(["parallel.tp=2"], world_size=2)
        print(sorted(m for m in ("torch", "megatron", "transformers") if m in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"


def test_hydra_main_app_writes_nothing_and_can_call_load_config(tmp_path: Path) -> None:
    app_dir, work_dir = tmp_path / "app", tmp_path / "work"
    app_dir.mkdir()
    work_dir.mkdir()
    (app_dir / "app.py").write_text(
        textwrap.dedent(
            f"""
            import os
            import hydra
            from hydra.core.hydra_config import HydraConfig
            from megatron_rl.config import load_config, to_typed

            @hydra.main(config_path={str(CONF_DIR)!r}, config_name="config", version_base="1.3")
            def main(cfg):
                typed = to_typed(cfg)
                nested = load_config(["parallel.tp=2"], world_size=2)
                print("RESULT", typed.parallel.tp, nested.parallel.tp, os.getcwd() == {str(work_dir)!r},
                      HydraConfig.get().runtime.output_dir == {str(work_dir)!r})

            main()
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(app_dir / "app.py"), "parallel.tp=1", "logging.level=DEBUG"],
        cwd=work_dir,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "RESULT 1 2 True True" in out.stdout
    assert sorted(work_dir.rglob("*")) == []
    assert sorted(p.name for p in app_dir.iterdir()) == ["app.py"]


def test_dense_layers_have_one_spelling() -> None:
    """Checkpoints compare the layout: [2, 0] and [0, 2] are the same model."""
    model = load_config(["model=tiny_qwen3_moe", "model.moe_dense_layers=[2,0]"], world_size=1).model
    assert model.moe_dense_layers == [0, 2] and model.moe_layer_pattern == [0, 1, 0, 1]


def test_cfg_job_shows_the_architecture_read_from_the_checkpoint(tmp_path, capsys):
    """`--cfg job model=llama3_8b model.path=<a 3-layer Llama>` prints the 3 layers the run would build, not the
    preset's 32 (Hydra's own print shows the preset); without a checkpoint it falls back to Hydra's print."""
    import yaml

    from megatron_rl import runtime
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.hf import build_hf_model

    arch = dict(family="llama", num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                num_query_groups=2, vocab_size=128, tie_word_embeddings=False)
    build_hf_model(ModelConfig(**arch), seed=0).save_pretrained(tmp_path / "ckpt")
    assert runtime.start(["--cfg", "job", "model=llama3_8b", f"model.path={tmp_path / 'ckpt'}"], "megatron_rl.train") \
        is None
    shown = yaml.safe_load(capsys.readouterr().out)["model"]
    assert {k: shown[k] for k in arch if k != "family"} == {k: v for k, v in arch.items() if k != "family"}
    assert runtime.start(["--cfg", "job", "model=llama3_8b"], "megatron_rl.train") is None
    captured = capsys.readouterr()
    assert "num_layers: 32" in captured.out and "the model.* keys below are the preset's" in captured.err


def test_sandbox_images_are_checked_before_any_work(tmp_path):
    """sandbox.images: every path exists; bwrap takes root file system directories; the process runtime runs no
    image; a code task under apptainer needs one, a rule-checked task does not."""
    sif = tmp_path / "python.sif"
    sif.write_bytes(b"SIF")
    cases = [(["sandbox=apptainer", f"+sandbox.images.python={tmp_path / 'no.sif'}"], "does not exist"),
             ([f"+sandbox.images.python={sif}"], "is not a directory: the bwrap runtime"),
             (["sandbox.runtime=process", "sandbox.allow_unisolated=true", f"+sandbox.images.python={tmp_path}"],
              "runtime=process, which runs code on the host in no image"),
             (["sandbox=apptainer"], r"apptainer .* needs an image .*docs/examples/python.def")]
    for overrides, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_config(["mode=rl", *overrides], world_size=1)
    assert load_config(["mode=rl", "sandbox=apptainer", f"+sandbox.images.python={sif}"], world_size=1).sandbox.images \
        == {"python": str(sif)}
    assert load_config(["mode=rl", "sandbox=apptainer", "task=arithmetic"], world_size=1)  # no code: no image needed
    assert load_config(["mode=sft", "sandbox=apptainer"], world_size=1)
