"""The base config holds what a real model needs; the tiny models' settings come only from their preset
(conf/preset/tiny.yaml, which every conf/model/tiny_*.yaml includes) and the demo experiments."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import CONF_DIR, compose, to_typed
from megatron_rl.config.checks import PRETRAINED_LR_LIMIT, config_warnings
from megatron_rl.config.schema import TrainConfig

REAL_MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if not p.stem.startswith("tiny_"))
MATH_DATA = CONF_DIR.parent / "docs" / "examples" / "math.jsonl"
TINY_MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("tiny_*.yaml"))


def _typed(*overrides: str) -> TrainConfig:
    return to_typed(compose(list(overrides)))


@pytest.mark.parametrize("model", REAL_MODELS)
@pytest.mark.parametrize("cluster", ["local", "slurm"])
def test_a_real_model_gets_no_demo_value(model, cluster):
    cfg = _typed(f"model={model}", "model.path=/ckpt/x", "task=math", f"task.path={MATH_DATA}", f"cluster={cluster}")
    assert (cfg.task.type, cfg.task.reward, cfg.task.num_train) == ("dataset", "math", None)  # the user's rows, all
    assert cfg.optimizer.lr <= 1e-5
    assert cfg.rollout.max_new_tokens >= 2048
    assert cfg.rollout.max_new_tokens < cfg.model.max_position_embeddings
    assert cfg.micro_batch_tokens >= cfg.rollout.max_new_tokens + 1024  # room for a prompt
    assert cfg.task.chat_template is None  # the tokenizer's template whenever it has one
    assert cfg.checkpoint.save_every >= 1
    assert cfg.task.sft_warmup_lr <= 1e-4
    if cluster == "slurm":  # cluster/slurm.yaml: cluster.device=cuda, code rewards in Apptainer
        assert (cfg.rollout.backend, cfg.sandbox.runtime) == ("sglang", "apptainer")
    assert config_warnings(cfg) == []


@pytest.mark.parametrize("model", TINY_MODELS)
def test_every_tiny_model_takes_the_preset(model):
    preset = (CONF_DIR / "preset" / "tiny.yaml").read_text()
    cfg = _typed(f"model={model}")
    assert (cfg.optimizer.lr, cfg.rollout.max_new_tokens, cfg.rollout.backend) == (1e-3, 32, "hf")
    assert (cfg.task.chat_template, cfg.checkpoint.save_every, cfg.micro_batch_tokens) == (False, 0, 2048)
    assert "/preset@_global_: tiny" in (CONF_DIR / "model" / f"{model}.yaml").read_text()
    assert "lr: 1.0e-3" in preset


def test_the_base_schema_holds_real_values_and_the_preset_overrides_only_what_it_names():
    from megatron_rl.config import OptimizerConfig, RolloutConfig

    assert (OptimizerConfig().lr, RolloutConfig().max_new_tokens, RolloutConfig().backend) == (1e-6, 4096, "auto")
    assert TrainConfig().micro_batch_tokens == 8192
    cfg = _typed("model=tiny_llama", "optimizer.lr=3e-4", "rollout.max_new_tokens=8")
    assert (cfg.optimizer.lr, cfg.rollout.max_new_tokens) == (3e-4, 8)  # the command line wins over the preset


def test_backend_auto_follows_the_device(monkeypatch):
    from megatron_rl.config import schema

    cfg = _typed("model=qwen2_5_7b", "model.path=/ckpt/x", "cluster.device=cpu")
    assert cfg.rollout.backend == "hf"
    monkeypatch.setattr(schema, "nvidia_gpu_visible", lambda: True)
    assert _typed("model=qwen2_5_7b", "model.path=/ckpt/x").rollout.backend == "sglang"
    assert _typed("model=qwen2_5_7b", "model.path=/ckpt/x", "cluster.device=cpu").rollout.backend == "hf"
    monkeypatch.setattr(schema, "nvidia_gpu_visible", lambda: False)
    assert _typed("model=qwen2_5_7b", "model.path=/ckpt/x").rollout.backend == "hf"


def _fast_path(cfg: TrainConfig) -> tuple:
    return _flags(cfg.parallel)


def _flags(par) -> tuple:
    return par.use_distributed_optimizer, par.overlap_grad_reduce, par.overlap_param_gather


def test_the_data_parallel_fast_path_is_on_with_gpus_and_off_on_cpu(monkeypatch):
    """parallel.use_distributed_optimizer, overlap_grad_reduce and overlap_param_gather: null (the default) is
    resolved when the config is typed, from cluster.device as rollout.backend=auto is; set values win."""
    from megatron_rl.config import ParallelConfig, schema

    assert _flags(ParallelConfig()) == (None, None, None)  # the schema's default: decided when typed
    monkeypatch.setattr(schema, "nvidia_gpu_visible", lambda: True)
    assert _fast_path(_typed()) == (True, True, True)  # cluster.device=auto
    assert _fast_path(_typed("cluster.device=cuda")) == (True, True, True)
    assert _fast_path(_typed("cluster.device=cpu")) == (False, False, False)
    monkeypatch.setattr(schema, "nvidia_gpu_visible", lambda: False)
    assert _fast_path(_typed()) == (False, False, False)
    assert _fast_path(_typed("cluster.device=cuda")) == (True, True, True)
    assert _fast_path(_typed("cluster=slurm")) == (True, True, True)  # cluster/slurm.yaml: cluster.device=cuda
    # set values win; overlap_param_gather's default follows the distributed optimizer
    assert _fast_path(_typed("cluster.device=cuda", "parallel.overlap_grad_reduce=false")) == (True, False, True)
    assert _fast_path(_typed("cluster.device=cuda", "parallel.use_distributed_optimizer=false")) == (False, True, False)
    assert _fast_path(_typed("cluster.device=cuda", "parallel.overlap_param_gather=false")) == (True, True, False)
    assert _fast_path(_typed("cluster.device=cpu", "parallel.use_distributed_optimizer=true")) == (True, False, False)
    assert _fast_path(_typed("cluster.device=cpu", "parallel.use_distributed_optimizer=true",
                             "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true")) == (True,) * 3


def test_the_run_config_holds_the_resolved_fast_path(monkeypatch, tmp_path):
    """config.yaml (written as the runtime writes it) holds the choices, which typing it again keeps whatever
    the machine that reads it (offline evaluation reads a run's config.yaml so)."""
    from omegaconf import OmegaConf

    from megatron_rl.config import schema

    monkeypatch.setattr(schema, "nvidia_gpu_visible", lambda: True)
    OmegaConf.save(OmegaConf.structured(_typed()), tmp_path / "config.yaml")
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert (saved.parallel.use_distributed_optimizer, saved.parallel.overlap_param_gather) == (True, True)
    monkeypatch.setattr(schema, "nvidia_gpu_visible", lambda: False)
    assert _fast_path(to_typed(OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))) == (True,) * 3


def test_gpu_visibility_respects_cuda_visible_devices(monkeypatch):
    from megatron_rl.config.schema import nvidia_gpu_visible

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert nvidia_gpu_visible() is False
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert nvidia_gpu_visible() == (Path("/proc/driver/nvidia/gpus").is_dir()
                                    and any(Path("/proc/driver/nvidia/gpus").iterdir()))


def test_a_large_learning_rate_on_a_pretrained_model_is_warned_of():
    cfg = _typed("model=qwen2_5_7b", "model.path=/ckpt/x", "optimizer.lr=1e-3")
    (warning,) = config_warnings(cfg)
    assert warning.startswith("optimizer.lr=0.001 with a pretrained model")
    warm = _typed("model=qwen2_5_7b", "model.path=/ckpt/x", "task.sft_warmup_steps=5", "task.sft_warmup_lr=5e-4")
    assert [w.split("=")[0] for w in config_warnings(warm)] == ["task.sft_warmup_lr"]
    at_limit = _typed("model=qwen2_5_7b", "model.path=/ckpt/x", f"optimizer.lr={PRETRAINED_LR_LIMIT}")
    assert config_warnings(at_limit) == []
    assert config_warnings(_typed("model=tiny_qwen2")) == []  # random init: 1e-3 is right
