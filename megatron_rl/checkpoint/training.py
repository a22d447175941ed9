"""Training checkpoints: Megatron distributed checkpoints of model + optimizer, plus LR
schedule, RNG states, data position, step and config, saved atomically with retention.

Layout under `<run_dir>/checkpoints/`:

    step_00000010/          one complete checkpoint (Megatron `dist_checkpointing`, torch_dist)
        meta.json           written last: step, layout, config; its presence marks completeness
        manifest.json       size and SHA-256 of every other file, written before meta.json
        rng/rank{r}.pt      every rank's RNG states
    latest                  the name of the newest complete checkpoint (replaced atomically)
    best                    with checkpoint.keep_best: the one with the best checkpoint.best_metric

A save writes into `step_N.tmp/` and renames it only after every rank has finished and
`manifest.json` and `meta.json` are on disk, then swaps `latest`; a crash at any point leaves the
previous checkpoint as the one `find_latest` returns. A checkpoint damaged afterwards (a file
truncated, zeroed, changed or deleted) is found against its manifest (`integrity`): resuming skips it
for the newest intact one (`find_intact`), loading refuses it (`load_weights`, `load_checkpoint`), both
naming the file and the damage. Model and optimizer state are saved in Megatron's reshardable formats, so a
checkpoint loads at a different TP/PP/CP/DP layout (RNG states are restored only at the layout
that wrote them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.checkpoint.integrity import (MANIFEST, DamagedCheckpoint, damage_over_ranks, refuse_damaged,
                                              write_manifest)

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LATEST = "latest"
_BEST = "best"
_META = "meta.json"
_CRITIC = "critic."  # the critic's keys in a checkpoint (algorithm.critic)
# Architecture fields a checkpoint must agree on with the run that loads it.
_ARCH_FIELDS = ("family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "head_dim", "vocab_size", "tie_word_embeddings", "qkv_bias", "mlp_bias",
                "qk_layernorm", "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_norm_topk_prob",
                "moe_shared_expert_intermediate_size", "moe_dense_layers", "rope_scaling_factor", "rotary_percent",
                "moe_router_num_groups", "moe_router_group_topk", "moe_routed_scaling_factor",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "sliding_window", "sliding_window_layers", "swiglu_limit",
                "rope_scaling_original_max_position_embeddings", "rope_scaling_beta_fast", "rope_scaling_beta_slow",
                "rope_scaling_mscale", "rope_scaling_mscale_all_dim", "rope_scaling_truncate", "rope_scaling_type",
                "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor", "rope_theta", "norm_eps",
                "lora_rank", "lora_alpha", "lora_targets")  # LoRA: the adapters' shapes and the merged model


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _complete(path: Path) -> bool:
    return path.is_dir() and (path / _META).is_file()


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and _complete(p)]
    return sorted(found)


def find_latest(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under `root`, or None."""
    root = Path(root)
    pointer = root / _LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if _complete(candidate):
            return candidate
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def find_best(root: Path) -> Optional[Path]:
    """The complete checkpoint `best` names (retention with checkpoint.keep_best writes it), or None."""
    pointer = Path(root) / _BEST
    if not pointer.is_file():
        return None
    candidate = Path(root) / pointer.read_text().strip()
    return candidate if _complete(candidate) else None


def find_intact(root: Path) -> Optional[Path]:
    """The checkpoint to resume from: `find_latest`'s, or when that is damaged the newest intact one
    (each damaged one logged with its files and skipped); None when there is none. Collective when
    distributed (the ranks share the reading). Raises DamagedCheckpoint when every checkpoint is damaged:
    starting afresh beside them would be silent."""
    root = Path(root)
    newest = find_latest(root)
    if newest is None:
        return None
    damaged: dict[Path, list[str]] = {}
    for path in [newest] + [p for _, p in reversed(list_checkpoints(root)) if p != newest]:
        problems = damage_over_ranks(path)
        if not problems:
            if damaged:
                logger.warning("resuming from %s, the newest intact checkpoint (skipped as damaged: %s)", path,
                               ", ".join(p.name for p in damaged))
            return path
        logger.warning("checkpoint %s is damaged and is skipped: %s", path, "; ".join(problems))
        damaged[path] = problems
    every = [f"{p.name}/{problem}" for p, problems in damaged.items() for problem in problems]
    raise DamagedCheckpoint(root, every, f"every checkpoint under {root} is damaged ({'; '.join(every)}): restore "
                                         "them, or move them away to start afresh")


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded_state_dict(trainer, is_loading: bool, prefix: str = "") -> dict[str, Any]:
    """Model, optimizer, schedule and step counts of `trainer`; model keys under `prefix` (the critic's
    "critic.", unique beside the policy's). Saving reads the weights: gathered first (`Trainer.gather_params`)."""
    if not is_loading:
        trainer.gather_params()
    model_sd = trainer.module.sharded_state_dict(prefix=prefix)
    metadata = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
    optim_sd = trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": optim_sd, "scheduler": trainer.scheduler.state_dict(),
            "trainer_step": trainer.step, "optimizer_step": trainer.optimizer_step}


def _layout(groups) -> dict[str, int]:
    return {"world_size": groups.world_size, "tp": groups.tp_size, "pp": groups.pp_size, "cp": groups.cp_size,
            "dp": groups.dp_size, "ep": groups.ep_size, "etp": groups.etp_size}


def saved_layout_of(meta: dict[str, Any]) -> dict[str, int]:
    """The parallel layout a checkpoint's meta.json records, with what older checkpoints did not record: ep and
    cp 1 (before expert / context parallelism), and the expert TP size (before parallel.etp was recorded:
    the run's setting, or its default, 1 for gpt-oss's biased experts, else tp)."""
    layout = {"ep": 1, "cp": 1, **meta["layout"]}
    if "etp" not in layout:
        config = meta.get("config", {})
        etp = config.get("parallel", {}).get("etp")
        biased = config.get("model", {}).get("family") == "gpt_oss"  # ModelConfig.linear_bias
        layout["etp"] = etp if etp is not None else (1 if biased else layout["tp"])
    return layout


def _expert_optimizer(layout: dict[str, int]) -> bool:
    """Whether Megatron-core keeps the experts in an optimizer of their own: when they are expert-parallel
    (ep > 1), or reduced over their own data-parallel group (etp != tp: models/gpt.py tags them so)."""
    return layout["ep"] > 1 or layout["etp"] != layout["tp"]


_SCHEDULE_FIELDS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """Retention also keeps the `count` checkpoints whose meta.json "metrics" hold the best `metric`
    (`mode` max or min), and `best` in the checkpoint directory names the best one. A checkpoint
    without a finite value of the metric is no candidate."""

    count: int
    metric: str
    mode: str = "max"


def save_checkpoint(trainer, root: Path, step: int, extra: dict[str, Any], config: dict[str, Any],
                    keep_last: int = 2, keep_every: Optional[int] = None, keep_best: Optional[KeepBest] = None,
                    metrics: Optional[dict[str, float]] = None, critic: Any = None,
                    meta: Optional[dict[str, Any]] = None) -> Path:
    """Save everything needed to resume after `step` optimizer steps; every rank calls this.

    `extra` holds small picklable state (data sampler position, ...); `config` is the run's
    config as plain data (stored in meta.json, checked on load); `metrics` (the last step's
    logged metrics) go into meta.json for `keep_best`; `critic` (a value-head Trainer) is saved
    beside the policy under "critic." keys; `meta`: more meta.json fields, readable before loading
    (`read_meta`).
    """
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = trainer.groups.rank
    start = time.perf_counter()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    extra = dict(extra)
    reference = extra.pop("reference", None)  # this rank's shards: saved sharded, not in rank 0's common state
    state = _sharded_state_dict(trainer, is_loading=False)
    if reference is not None:
        state["reference"] = _reference_sharded_state_dict(trainer, reference)
    if critic is not None:
        state["critic"] = _sharded_state_dict(critic, is_loading=False, prefix=_CRITIC)
    state["extra"] = extra
    _results_in_this_process()
    dist_checkpointing.save(state, str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    _barrier()
    hash_start = time.perf_counter()
    write_manifest(tmp, rank)
    hashing = time.perf_counter() - hash_start
    if rank == 0:
        written = {**(meta or {}), "step": step, "layout": _layout(trainer.groups), "manifest": MANIFEST,
                   "device": trainer.groups.device.type, "config": config, "time": time.time(),
                   "distributed_optimizer": trainer.options.use_distributed_optimizer,
                   "reference": reference is not None, "critic": critic is not None,
                   "metrics": {k: float(v) for k, v in (metrics or {}).items()
                               if isinstance(v, (int, float)) and math.isfinite(v)}}
        with open(tmp / _META, "w") as f:
            json.dump(written, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root, final.name)
        _apply_retention(root, keep_last, keep_every, saved=step, keep_best=keep_best)
    _barrier()
    logger.info("saved checkpoint %s (%.2fs, of which %.2fs hashing)", final, time.perf_counter() - start, hashing)
    return final


def _results_in_this_process() -> None:
    """Let Megatron's torch_dist writer hand its write results back through a plain queue.

    The writer gets that queue from a multiprocessing Manager it *spawns* on first use, made for
    Megatron's asynchronous save, where another process writes. Our saves are synchronous: the
    writer's own forked workers report through a queue of their own, and the results are put and
    taken in this process, so a plain queue serves. It spares every rank the spawned server,
    which re-imports the main module (torch and all: ~4 s on a run's first save on CPU) and stays
    alive until the rank exits. A new queue each save: a save that failed between the writer's put
    and the read leaves nothing for the next. Should Megatron rename the attribute, the assignment
    changes nothing and the Manager is spawned as before."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if isinstance(getattr(filesystem_async, "_results_queue", None), (queue.Queue, type(None))):
        filesystem_async._results_queue = queue.Queue()


def _reference_sharded_state_dict(trainer, reference: Optional[list[torch.Tensor]]) -> dict[str, Any]:
    """The KL reference policy (`Trainer.snapshot_weights()`, this rank's shards) as a sharded state dict
    under the keys "reference.<model key>", so that it reshards like the model (it travelled in the
    common state before, which holds rank 0's copy only). The tensors are copies: saving and loading
    leave the model's own parameters alone. `reference` None: the structure for loading."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    current = trainer.swap_weights(reference) if reference is not None else None
    try:
        sharded = trainer.module.sharded_state_dict(prefix="reference.")
        if trainer.model_cfg.lora_rank:  # the frozen weights are the model's own: only the adapters differ
            sharded = {key: value for key, value in sharded.items() if _reference_part(key)}

        def detach(value: Any) -> Any:
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and isinstance(value.data, torch.Tensor):
                value.data = value.data.detach().clone()
            return value
        dict_list_map_inplace(detach, sharded)
    finally:
        if current is not None:
            trainer.swap_weights(current)
    return sharded


def _reference_part(key: str) -> bool:
    """A LoRA model's reference keeps the adapters and the weight buffers (`Trainer._weight_tensors`)."""
    from megatron_rl.models.lora import is_adapter_param
    from megatron_rl.weight_sync.sharding import WEIGHT_BUFFERS

    return is_adapter_param(key) or key.endswith(WEIGHT_BUFFERS)


def _load_reference(trainer, loaded: dict[str, Any]) -> list[torch.Tensor]:
    """The reference snapshot (`snapshot_weights` order) from its loaded state dict."""
    current = trainer.snapshot_weights()
    trainer.module.load_state_dict({key[len("reference."):]: value for key, value in loaded.items()},
                                   strict=not trainer.model_cfg.lora_rank)
    reference = trainer.snapshot_weights()
    trainer.swap_weights(current)
    return reference


def _write_latest(root: Path, name: str) -> None:
    _write_pointer(root, _LATEST, name)


def _write_pointer(root: Path, pointer: str, name: str) -> None:
    tmp = root / (pointer + ".tmp")
    tmp.write_text(name + "\n")
    os.replace(tmp, root / pointer)


def _metric_of(path: Path, metric: str) -> Optional[float]:
    try:
        value = json.loads((path / _META).read_text()).get("metrics", {}).get(metric)
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def best_checkpoints(root: Path, keep_best: KeepBest) -> list[tuple[int, Path]]:
    """The complete checkpoints with a value of `keep_best.metric`, best first (ties: the later step)."""
    scored = [(value, step, path) for step, path in list_checkpoints(root)
              if (value := _metric_of(path, keep_best.metric)) is not None]
    sign = 1.0 if keep_best.mode == "max" else -1.0
    return [(step, path) for _, step, path in sorted(scored, key=lambda x: (sign * x[0], x[1]), reverse=True)]


def _apply_retention(root: Path, keep_last: int, keep_every: Optional[int], saved: Optional[int] = None,
                     keep_best: Optional[KeepBest] = None) -> None:
    """Keep the `keep_last` newest, every multiple of `keep_every`, the `keep_best` best and always the one
    just `saved` (the directory may hold higher steps of an earlier run: ranked by step, the new one would
    go at once); point `best` at the best one."""
    found = list_checkpoints(root)
    keep = {step for step, _ in found[-keep_last:]} | ({saved} if saved is not None else set())
    if keep_every:
        keep |= {step for step, _ in found if step % keep_every == 0}
    if keep_best is not None and keep_best.count > 0:
        best = best_checkpoints(root, keep_best)
        keep |= {step for step, _ in best[:keep_best.count]}
        if best:
            _write_pointer(root, _BEST, best[0][1].name)
    for step, path in found:
        if step not in keep:
            shutil.rmtree(path, ignore_errors=True)
    for stale in root.glob("step_*.tmp"):  # left by a crash in an earlier save
        shutil.rmtree(stale, ignore_errors=True)


def read_meta(path: Path) -> dict[str, Any]:
    """meta.json of the checkpoint `path`."""
    return json.loads((Path(path) / _META).read_text())


def check_compatible(path: Path, model_cfg: Any) -> dict[str, Any]:
    """meta.json of `path`, after checking its architecture matches `model_cfg`."""
    meta = read_meta(path)
    saved = meta.get("config", {}).get("model", {})
    current = dataclasses.asdict(model_cfg) if dataclasses.is_dataclass(model_cfg) else dict(model_cfg)
    for key in _ARCH_FIELDS:
        if key in saved and saved[key] != current.get(key):
            raise ValueError(f"checkpoint {path} was written for model.{key}={saved[key]}, "
                             f"this run has model.{key}={current.get(key)}")
    return meta


def _ensure_optimizer_state(optimizer) -> None:
    """A distributed optimizer that never stepped has no state to load into; Megatron fills it
    with placeholders (a zero-gradient step whose results the checkpoint then overwrites)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer, step: int) -> None:
    """torch.optim.Adam (the optimizer without TE/Apex) counts steps per parameter; the
    distributed optimizer's checkpoint does not carry that count, and its loader puts one
    shared tensor in every parameter's state (which Adam would then increment once per
    parameter per step). Give each parameter its own count, the steps this optimizer took
    (every step is applied in fp32: none is skipped; a warm start's steps belong to the
    optimizer it used, not to the one built after it)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for state in inner.state.values():
            old = state.get("step")
            if isinstance(old, torch.Tensor):
                state["step"] = torch.tensor(float(step), dtype=old.dtype, device=old.device)


def load_weights(trainer, path: Path) -> int:
    """Only the model's weights of a training checkpoint, into a trainer at any layout (TP, PP, EP, CP and
    the optimizer's kind may all differ from the saving run's: Megatron-core's sharded model state
    reshards; the optimizer state, which does not across EP, is not read). For evaluation and export,
    never for resuming. Returns the checkpoint's step; a damaged checkpoint is refused (DamagedCheckpoint,
    naming the file: the ranks check it against its manifest first)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    refuse_damaged(path)
    meta = check_compatible(path, trainer.model_cfg)
    state = dist_checkpointing.load({"model": trainer.module.sharded_state_dict()}, str(path))
    trainer.module.load_state_dict(state["model"])
    trainer.weights_loaded += 1
    logger.info("loaded the weights of checkpoint %s (step %d, written at layout %s)", path, meta["step"],
                meta["layout"])
    return int(meta["step"])


def _restore(trainer, state: dict[str, Any], path: Path, prefix: str = "") -> None:
    """Model, optimizer, LR schedule and step counts of `trainer` from its loaded `_sharded_state_dict`."""
    trainer.module.load_state_dict({key[len(prefix):]: value for key, value in state["model"].items()})
    trainer.weights_loaded += 1
    trainer.optimizer.load_state_dict(state["optimizer"])
    changed = {k: (v, getattr(trainer.scheduler, k)) for k, v in state["scheduler"].items()
               if k in _SCHEDULE_FIELDS and getattr(trainer.scheduler, k) != v}
    if changed:
        logger.warning("checkpoint %s: the LR schedule%s follows this run's config, which changed %s", path,
                       " of the critic" if prefix else "",
                       ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
    # Megatron's scheduler *adds* the saved step count to its current one.
    trainer.scheduler.num_steps = 0
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.step = int(state["trainer_step"])
    # Checkpoints from before optimizer_step was saved never reset their optimizer.
    trainer.optimizer_step = int(state.get("optimizer_step", trainer.step))
    _restore_adam_steps(trainer.optimizer, trainer.optimizer_step)


def load_checkpoint(trainer, path: Path, critic: Any = None, verify: bool = True) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, step (and RNG at the same layout); returns `extra`, with
    "critic": True when `critic` (a value-head Trainer) was restored too (absent: the checkpoint has none).
    A damaged checkpoint is refused (DamagedCheckpoint); `verify` False skips that check, for a checkpoint
    `find_intact` just chose."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if verify:
        refuse_damaged(path)
    meta = check_compatible(path, trainer.model_cfg)
    saved_layout = saved_layout_of(meta)
    current = _layout(trainer.groups)
    if _expert_optimizer(saved_layout) != _expert_optimizer(current):
        # Megatron-core keeps expert parameters in an optimizer of their own when they are expert-parallel
        # (or reduced over their own data-parallel group: models/gpt.py) and saves a chained optimizer in
        # another structure (optimizer.py:1200-1213); loading across that fails inside Megatron
        # (optimizer.py:413), so it is refused here with the fix. Between two layouts that both have it
        # (EP 2 -> 4, EP 2 -> EP 1 with experts unsplit over TP=2), the state reshards.
        where = {True: "an optimizer of their own", False: "the dense optimizer"}
        saved_how = (f"parallel.ep={saved_layout['ep']}, parallel.tp={saved_layout['tp']}, expert TP "
                     f"{saved_layout['etp']}")
        current_how = f"parallel.ep={current['ep']}, parallel.tp={current['tp']}, expert TP {current['etp']}"
        raise ValueError(f"checkpoint {path} keeps the experts in {where[_expert_optimizer(saved_layout)]} "
                         f"({saved_how}), this run in {where[_expert_optimizer(current)]} ({current_how}): "
                         "Megatron-core cannot load an optimizer across that; resume at a layout that keeps them "
                         "where the checkpoint has them: "
                         + ("parallel.ep > 1, or parallel.etp=1 at parallel.tp > 1" if _expert_optimizer(saved_layout)
                            else f"parallel.ep=1 with expert TP equal to parallel.tp (parallel.ep="
                                 f"{saved_layout['ep']} as written)"))
    saved_distopt = meta.get("distributed_optimizer", False)
    if saved_distopt != trainer.options.use_distributed_optimizer:
        # The two optimizers store their state in different structures (distrib_optimizer.py:1175
        # vs optimizer.py:307); Megatron-core cannot load one into the other.
        raise ValueError(f"checkpoint {path} was written with parallel.use_distributed_optimizer="
                         f"{str(saved_distopt).lower()}, this run has "
                         f"{str(trainer.options.use_distributed_optimizer).lower()}: set "
                         f"parallel.use_distributed_optimizer={str(saved_distopt).lower()} to resume from it (its "
                         "default, null, is on when the trainer runs on GPUs and off on CPU)")
    start = time.perf_counter()
    _ensure_optimizer_state(trainer.optimizer)
    wanted = _sharded_state_dict(trainer, is_loading=True)
    if meta.get("reference"):
        wanted["reference"] = _reference_sharded_state_dict(trainer, None)
    with_critic = critic is not None and bool(meta.get("critic"))
    if with_critic:
        _ensure_optimizer_state(critic.optimizer)
        wanted["critic"] = _sharded_state_dict(critic, is_loading=True, prefix=_CRITIC)
    state = dist_checkpointing.load(wanted, str(path))
    _restore(trainer, state, path)
    if with_critic:
        _restore(critic, state["critic"], path, prefix=_CRITIC)
    rng_file = path / "rng" / f"rank{trainer.groups.rank}.pt"
    # A CPU run's tracker holds CPU generator states, which a CUDA generator refuses (and the other way round);
    # checkpoints from before the device was recorded were all written on CPU.
    saved_device = meta.get("device", "cpu")
    if saved_layout == _layout(trainer.groups) and saved_device == trainer.groups.device.type and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("checkpoint %s was written at layout %s on %s; RNG states are not restored at %s on %s",
                       path, meta["layout"], saved_device, _layout(trainer.groups), trainer.groups.device.type)
    extra = dict(state.get("extra", {}))
    if with_critic:
        extra["critic"] = True
    if meta.get("reference"):
        extra["reference"] = _load_reference(trainer, state["reference"])
    elif extra.get("reference") is not None and (saved_layout["tp"] > 1 or saved_layout["pp"] > 1
                                                 or saved_layout["ep"] > 1):
        # written before the reference was saved sharded: its common state holds rank 0's shards only, which
        # are no reference for the other ranks; dropped (a run with kl_coef > 0 then refuses to resume, naming it)
        logger.warning("checkpoint %s keeps its KL reference policy as rank 0's shards only (written before "
                       "references were saved sharded, at layout %s): the reference is dropped", path, saved_layout)
        extra["reference"] = None
    logger.info("loaded checkpoint %s at step %d (%.2fs)", path, meta["step"], time.perf_counter() - start)
    return extra
