"""The single owner of the colocated phase order and of the memory plan.

One rollout, colocated (every rank trains and generates on the same device):

    offload trainer -> resume engine weights -> weight sync -> resume KV cache -> generate
    -> release engine (weights + KV cache) -> onload trainer

On GPU each step really moves memory (Megatron's buffers to pinned host memory, SGLang's
memory saver); on CPU the same calls run in the same order (the hf engine even frees its
weights), so the order is tested everywhere. Every phase is timed; `phase_log` records the
order for tests and the step timeline.

With `weight_sync="adapters"` (a LoRA run, rollout.weight_sync=adapters) the first rollout syncs the trainer's
frozen base weights and its adapters, and later ones only the adapters: the engine keeps its weights
between rollouts (only its KV cache is released and resumed). A rollout that fails hands everything back,
weights included, and the next one syncs the base again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Optional, TypeVar

from megatron_rl.rollout.base import TAG_KV_CACHE, TAG_WEIGHTS
from megatron_rl.weight_sync.stream import SyncStats, sync_adapters, sync_weights

logger = logging.getLogger(__name__)
T = TypeVar("T")

# one rollout's phases, in order (with a critic, "offload_critic" follows "offload_trainer")
PHASES = ("offload_trainer", "resume_engine_weights", "sync_weights", "resume_engine_kv", "generate",
          "release_engine", "onload_trainer")


def sync_policy(model: Any, groups: Any, arch: Any, engine: Optional[Any], version: int, bucket_bytes: int,
                weight_sync: str = "full", adapters_only: bool = False) -> SyncStats:
    """A rollout's weight sync by `rollout.weight_sync` (this controller's, and disaggregated mode's publish):
    "full", the merged weights; "adapters", the base weights (unmerged) and then the adapters, or with
    `adapters_only` (the engine holds this base already) the adapters alone. Every model-parallel rank calls it."""
    if weight_sync == "full":
        return sync_weights(model, groups, arch, engine, version, bucket_bytes)
    if adapters_only:
        return sync_adapters(model, groups, arch, engine, version)
    base = sync_weights(model, groups, arch, engine, version, bucket_bytes, merged=False)
    adapters = sync_adapters(model, groups, arch, engine, version)
    return SyncStats(version, base.num_tensors + adapters.num_tensors, base.num_bytes + adapters.num_bytes,
                     base.num_buckets + adapters.num_buckets, base.seconds + adapters.seconds)


class ColocationController:
    def __init__(self, trainer: Any, engine: Optional[Any], bucket_bytes: int = 256 * 2**20,
                 critic: Optional[Any] = None, weight_sync: str = "full") -> None:
        if weight_sync not in ("full", "adapters"):
            raise ValueError(f"weight_sync={weight_sync!r}; allowed: full, adapters")
        self.trainer = trainer
        self.weight_sync = weight_sync
        # weight_sync=adapters: the trainer's `weights_loaded` count when the engine got the base weights it holds
        # (None: it holds none); loading weights into the trainer again may change the base
        self._base_of: Optional[int] = None
        self.critic = critic  # a value model (algorithm.critic): offloaded and onloaded with the trainer
        self.engine = engine  # None on ranks that own no engine (they still take part in sync)
        self.bucket_bytes = bucket_bytes
        self.phase_log: list[str] = []
        self.timings: dict[str, float] = {}
        self.version = 0
        self.last_sync: Optional[SyncStats] = None
        self.timeline: Any = None  # an observability.timeline.Timeline to record the phases on, if set

    def log_memory_plan(self, kv_budget_bytes: Optional[int] = None) -> dict[str, int]:
        plan = self.trainer.memory_plan()
        if self.engine is None:
            engine = "no rollout engine in this process"
        else:
            engine = "engine weights = params in HF layout%s; KV cache budget %s" % (
                " (kept between rollouts: only the LoRA adapters are synced)" if self.weight_sync == "adapters"
                else "", "engine default" if kv_budget_bytes is None else f"{kv_budget_bytes / 1e6:.1f} MB")
        logger.info("memory plan: trainer params %.1f MB, grads %.1f MB, optimizer %.1f MB (offloaded during "
                    "rollout); %s", plan["params"] / 1e6, plan["grads"] / 1e6, plan["optimizer"] / 1e6, engine)
        if self.critic is not None:
            own = self.critic.memory_plan()
            logger.info("memory plan: critic params %.1f MB, grads %.1f MB, optimizer %.1f MB (offloaded during "
                        "rollout)", own["params"] / 1e6, own["grads"] / 1e6, own["optimizer"] / 1e6)
        return plan

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self.phase_log.append(name)
        try:
            yield
        finally:
            end = time.perf_counter()
            self.timings[f"time/{name}"] = end - start
            if self.timeline is not None:
                self.timeline.add(name, "phases", start, end)

    def rollout(self, generate: Callable[[], T]) -> T:
        """Run `generate()` with the engine holding the trainer's current weights. Whatever fails after
        the trainer's offload (engine resume, weight sync, generation), the engine releases its memory
        and the trainer gets its own back before the error propagates; the weight version advances only
        when the sync completed."""
        self.timings = {}
        version = self.version + 1
        with self._phase("offload_trainer"):
            self.trainer.offload()
        try:
            if self.critic is not None:  # inside: a failure hands the policy's memory back too
                with self._phase("offload_critic"):
                    self.critic.offload()
            adapters_only = self.weight_sync == "adapters" and self._base_of == self._weights_loaded()
            with self._phase("resume_engine_weights"):
                if self.engine is not None and not adapters_only:
                    self.engine.resume_memory([TAG_WEIGHTS])
            with self._phase("sync_weights"):
                self.trainer.onload_weights_for_sync(adapters_only=adapters_only)
                self.last_sync = self._sync(version, adapters_only)
                self.version = version
                self.trainer.offload_weights_after_sync(adapters_only=adapters_only)
            with self._phase("resume_engine_kv"):
                if self.engine is not None:
                    self.engine.resume_memory([TAG_KV_CACHE])
            with self._phase("generate"):
                result = generate()
        except BaseException:
            self._hand_back(failed=True)
            raise
        self._hand_back(failed=False)
        return result

    def _weights_loaded(self) -> int:
        return getattr(self.trainer, "weights_loaded", 0)

    def _sync(self, version: int, adapters_only: bool) -> SyncStats:
        stats = sync_policy(self.trainer.module, self.trainer.groups, self.trainer.model_cfg, self.engine, version,
                            self.bucket_bytes, self.weight_sync, adapters_only)
        if self.weight_sync == "adapters" and not adapters_only:
            self._base_of = self._weights_loaded()
        return stats

    def _hand_back(self, failed: bool) -> None:
        """Release the engine, then onload the trainer (also when the release fails). After a failed
        rollout a failing release is logged, not raised: the rollout's own error is the one to see."""
        keep_weights = self.weight_sync == "adapters" and self._base_of is not None and not failed
        if not keep_weights:
            self._base_of = None
        try:
            with self._phase("release_engine"):
                if self.engine is not None:
                    self.engine.release_memory([TAG_KV_CACHE] if keep_weights else [TAG_WEIGHTS, TAG_KV_CACHE])
        except Exception:
            if not failed:
                raise
            logger.exception("releasing the engine's memory after a failed rollout failed too")
        finally:
            with self._phase("onload_trainer"):
                self.trainer.onload()
                if self.critic is not None:
                    self.critic.onload()

    def metrics(self) -> dict[str, float]:
        out = dict(self.timings)
        if self.last_sync is not None:
            out.update(self.last_sync.metrics())
        return out
