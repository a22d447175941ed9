"""Build the configured rollout engine (`rollout.backend`, `rollout.tp`) on every rank.

`make_engine` maps the `RolloutConfig` onto an `HFEngine` or an `SGLangEngine` config and wires
the SPMD picture of the design: local ranks in blocks of `rollout.tp`, the block's first rank
owns the engine (for sglang: `Engine(tp_size=rollout.tp, base_gpu_id=<its GPU>)`), every rank
talks to it through a `BlockEngine` (`rollout.spmd`). With `rollout.tp=1` each rank owns its
engine and no wrapper is needed. `check_engine_config` is the part of it that can fail before
any process group or device is touched.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

SGLANG_INSTALL_HINT = ("pip install -e '.[sglang]' on GPU nodes; for CPU tests "
                       "bash tests/integration/sglang/setup.sh and run with that venv's python "
                       "(see docs/rollout.md)")


def job_shape(cfg: Any) -> tuple[int, int]:
    """(world size, ranks per node) of the job this process belongs to or will launch."""
    from megatron_rl.parallel.dist import dist_env_from

    env = dist_env_from()
    if env.source != "single":
        return env.world_size, env.local_world_size
    nproc = cfg.cluster.nproc if cfg.cluster.launcher == "local" else 1
    return nproc, nproc  # the local launcher starts every rank on this node


def check_engine_config(cfg: Any, world_size: int, local_world_size: int) -> None:
    """Refuse rollout settings this job cannot run, with the fix (raises ConfigError)."""
    from megatron_rl.checks import ConfigError

    r = cfg.rollout
    if local_world_size % r.tp:
        valid = [k for k in range(1, local_world_size + 1) if local_world_size % k == 0]
        raise ConfigError(f"rollout.tp={r.tp} does not divide the {local_world_size} ranks per node: one engine "
                          f"serves a block of rollout.tp ranks of one node; valid rollout.tp values are "
                          f"{', '.join(map(str, valid))}")
    if r.backend == "sglang":
        if cfg.model.family == "mixtral" and cfg.model.rope_scaling_factor is not None:
            # sglang/srt/models/mixtral.py builds plain RoPE (measured with SGLang 0.5.23 on CPU, YaRN factor 4:
            # its log-probs were 0.49 away from the trainer's; the other families' SGLang classes take the scaling)
            kind = "YaRN" if cfg.model.yarn else "Llama 3.1"
            raise ConfigError(f"model.rope_scaling_factor={cfg.model.rope_scaling_factor} ({kind} scaling) with "
                              "model.family=mixtral: SGLang's Mixtral ignores rope scaling, so its samples would not "
                              "be the trainer's policy; use rollout.backend=hf, or a model without rope scaling")
        if r.base_url is not None and world_size != r.tp:
            raise ConfigError(f"rollout.base_url={r.base_url} attaches one server to one block of rollout.tp="
                              f"{r.tp} ranks, but the job has {world_size} ranks: set rollout.tp={world_size} "
                              "(and start the server with that --tp-size) or drop rollout.base_url")
        if importlib.util.find_spec("sglang") is None:
            raise ConfigError(f"rollout.backend=sglang needs sglang, which this Python ({_python()}) cannot "
                              f"import: {SGLANG_INSTALL_HINT}; or use rollout.backend=hf")


def _python() -> str:
    import sys

    return sys.executable


def sglang_engine_config(cfg: Any, *, device_type: str, model_path: Optional[str], base_gpu_id: int,
                         random_seed: int, tokenizer_path: Optional[str] = None,
                         eos_token_id: Optional[int] = None) -> Any:
    """The `SGLangEngineConfig` of one block's engine (offline with `model_path`, else attach). With stop
    strings (rollout.stop) the engine loads a tokenizer (from `tokenizer_path`, else the model's): SGLang
    matches them on the text; an attached server must have been started with one. `eos_token_id`: the run's
    tokenizer's (`SGLangEngineConfig.eos_token_ids`)."""
    from megatron_rl.rollout.sglang_engine import SGLangEngineConfig

    r = cfg.rollout
    server_args: dict[str, Any] = {}
    if r.base_url is None:
        # The engine starts from random weights: the controller syncs the trainer's weights
        # before every rollout, so reading the checkpoint again would only cost time.
        server_args["load_format"] = "dummy"
    for key in ("attention_backend", "chunked_prefill_size", "max_total_tokens"):
        if getattr(r, key) is not None:
            server_args[key] = getattr(r, key)
    if r.disable_radix_cache:
        server_args["disable_radix_cache"] = True
    if r.kv_cache_dtype != "auto":
        server_args["kv_cache_dtype"] = r.kv_cache_dtype
    if cfg.model.trust_remote_code:  # e.g. Kimi-K2's config.json, which names a model_type of its own code
        server_args["trust_remote_code"] = True
    if tokenizer_path is not None:  # `_engine_dirs` saves one with stop strings only
        server_args["tokenizer_path"] = tokenizer_path
    layout = None
    if cfg.algorithm.routing_replay == "rollout":  # R3: generations return the experts of every token
        if device_type != "cuda":
            from megatron_rl.checks import ConfigError

            raise ConfigError("algorithm.routing_replay=rollout with rollout.backend=sglang needs CUDA: SGLang "
                              "captures the routed experts in pinned host memory; on CPU use rollout.backend=hf")
        server_args["enable_return_routed_experts"] = True
        m = cfg.model
        layout = (m.num_layers, tuple(m.sparse_layers), m.moe_router_topk)
    if r.weight_sync == "adapters":  # SGLang's LoRA serving, sized for the run's adapters
        from megatron_rl.families.convert.dense import LORA_HF_MODULES

        # two adapters in a batch at most: the run's (and none, SGLang's base, which no request uses) rather than
        # SGLang's default 8, whose buffers would be sized for eight
        server_args.update(enable_lora=True, max_lora_rank=cfg.model.lora_rank, max_loras_per_batch=2,
                           lora_target_modules=sorted({m for t in cfg.model.lora_targets for m in LORA_HF_MODULES[t]}))
    server_args.update(dict(r.server_args))
    eos = () if eos_token_id is None else (int(eos_token_id),)
    if r.base_url is not None:  # an attached server must have been started with enable_return_routed_experts
        return SGLangEngineConfig(base_url=r.base_url, device=device_type, tp_size=r.tp,
                                  skip_tokenizer_init=not r.stop, routing_layout=layout, head_copy=_head_copy(cfg),
                                  eos_token_ids=eos)
    return SGLangEngineConfig(
        model_path=model_path, device=device_type, tp_size=r.tp, base_gpu_id=base_gpu_id, dtype=cfg.model.dtype,
        mem_fraction_static=r.mem_fraction_static, random_seed=random_seed, log_level=r.log_level,
        skip_tokenizer_init=not r.stop, server_args=server_args, routing_layout=layout, head_copy=_head_copy(cfg),
        eos_token_ids=eos)


def _head_copy(cfg: Any) -> bool:
    """`SGLangEngineConfig.head_copy` for this run (`sglang_engine.needs_head_copy`; an attached server's
    pp_size is read from rollout.server_args too, where the run should say it)."""
    from megatron_rl.rollout.sglang_engine import needs_head_copy

    return needs_head_copy(cfg.model, int(dict(cfg.rollout.server_args).get("pp_size", 1)))


def engine_model_dir(cfg: Any, eos_token_id: int, work_dir: Path) -> str:
    """A directory SGLang can start the architecture from: `model.path` when it is an HF
    checkpoint, else an HF config written from the model fields (weights come by sync)."""
    from megatron_rl.models.hf import hf_config

    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        return str(cfg.model.path)
    work_dir.mkdir(parents=True, exist_ok=True)
    hf_config(cfg.model, eos_token_id).save_pretrained(work_dir)
    return str(work_dir)


def make_engine(cfg: Any, groups: Any, tokenizer: Any, *, local_rank: int, local_world_size: int,
                work_dir: Path) -> Any:
    """This rank's `RolloutEngine` for `cfg.rollout` (collective when rollout.tp > 1)."""
    from megatron_rl.parallel.state import rollout_block
    from megatron_rl.rollout.spmd import BlockEngine

    r = cfg.rollout
    block = rollout_block(r.tp, local_rank, local_world_size)
    if groups.rank == 0:  # the choice rollout.backend=auto made is written in config.yaml too
        logger.info("rollout engine: %s on %s, one per %d rank(s) (rollout.backend; auto: sglang on GPUs, hf on CPU)",
                    "SGLang" if r.backend == "sglang" else "transformers generate (hf)", groups.device.type, r.tp)
    engine = None
    serialize = None
    if block.is_leader:
        engine = _leader_engine(cfg, groups, tokenizer, block, work_dir)
    if r.backend == "sglang":
        from megatron_rl.rollout.sglang_engine import block_payload

        serialize = functools.partial(block_payload, as_text=r.base_url is not None, head_copy=_head_copy(cfg))
    if block.size == 1:
        return engine
    return BlockEngine(block, engine, serialize)


def _leader_engine(cfg: Any, groups: Any, tokenizer: Any, block: Any, work_dir: Path) -> Any:
    if cfg.rollout.backend == "hf":
        from megatron_rl.rollout.hf_engine import HFEngine

        return HFEngine(cfg.model, device=groups.device, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer,
                        max_batch_size=cfg.rollout.max_batch_size)
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    model_path, tokenizer_path = _engine_dirs(cfg, tokenizer, work_dir, f"rollout_model_rank{groups.rank}")
    config = sglang_engine_config(cfg, device_type=groups.device.type, model_path=model_path,
                                  base_gpu_id=groups.device.index or 0, random_seed=cfg.seed + groups.rank,
                                  tokenizer_path=tokenizer_path, eos_token_id=tokenizer.eos_token_id)
    engine = SGLangEngine(config)
    tp_size = engine.health()["tp_size"]
    if tp_size != block.size:
        engine.shutdown()
        where = cfg.rollout.base_url or model_path
        raise ValueError(f"the SGLang engine at {where} runs tp_size={tp_size}, but rollout.tp="
                         f"{block.size}: one payload per SGLang TP rank comes from each rank of the block; "
                         f"start the server with --tp-size {block.size} or set rollout.tp={tp_size}")
    return engine


def make_standalone_engine(cfg: Any, tokenizer: Any, *, device: Any, index: int, work_dir: Path) -> Any:
    """One `RolloutEngine` owned by a process outside the trainer's process groups (a
    disaggregated generator): no block, no collectives; an sglang engine spans rollout.tp GPUs
    from `device` on, as SGLang's own scheduler processes."""
    r = cfg.rollout
    if r.backend == "hf":
        from megatron_rl.rollout.hf_engine import HFEngine

        return HFEngine(cfg.model, device=device, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer, max_batch_size=r.max_batch_size)
    from megatron_rl.rollout.sglang_engine import SGLangEngine

    model_path, tokenizer_path = _engine_dirs(cfg, tokenizer, work_dir, f"generator{index}")
    return SGLangEngine(sglang_engine_config(cfg, device_type=device.type, model_path=model_path,
                                             base_gpu_id=device.index or 0, random_seed=cfg.seed + 7919 * (index + 1),
                                             tokenizer_path=tokenizer_path, eos_token_id=tokenizer.eos_token_id))


def _engine_dirs(cfg: Any, tokenizer: Any, work_dir: Path, name: str) -> tuple[Optional[str], Optional[str]]:
    """An offline SGLang engine's (model directory, tokenizer directory): the tokenizer only with stop
    strings (rollout.stop), which SGLang matches on text, saved from the run's own. (None, None) in
    attach mode (rollout.base_url)."""
    if cfg.rollout.base_url is not None:
        return None, None
    model_path = engine_model_dir(cfg, tokenizer.eos_token_id, work_dir / name)
    if not cfg.rollout.stop:
        return model_path, None
    tokenizer_path = work_dir / f"{name}_tokenizer"
    tokenizer.save_pretrained(str(tokenizer_path))
    return model_path, str(tokenizer_path)
