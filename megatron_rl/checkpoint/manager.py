"""When to save, resume and export, as the run configuration says (`checkpoint.*`).

The entry points call `resume()` once after building the trainer and `after_step(n)`
after every optimizer step; this module owns the directory layout under the run dir:
`checkpoints/` for training checkpoints and `hf/step_N/` for HF exports.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_rl.checkpoint.hf import export_hf
from megatron_rl.checkpoint.training import KeepBest, find_intact, load_checkpoint, read_meta, save_checkpoint

logger = logging.getLogger(__name__)


class CheckpointManager:
    def __init__(self, ckpt_cfg: Any, run_dir: Path, trainer: Any, run_config: Any, total_steps: int,
                 tokenizer: Any = None) -> None:
        self.cfg = ckpt_cfg
        self.root = Path(run_dir) / "checkpoints"
        self.hf_root = Path(run_dir) / "hf"
        self.trainer = trainer
        self.run_config = dataclasses.asdict(run_config) if dataclasses.is_dataclass(run_config) else run_config
        self.total_steps = total_steps
        self.tokenizer = tokenizer
        self.critic: Any = None  # an RL run's value model (algorithm.critic), saved and resumed with the policy
        self._looked = False  # find_intact reads every file of the checkpoint: asked once
        self._chosen: Optional[Path] = None
        self.longest_save_s: Optional[float] = None  # the longest `save` of this process so far (the stop's estimate)

    def _to_load(self) -> Optional[Path]:
        """The checkpoint `resume()` loads: the newest intact one (every rank calls this: collective)."""
        if not self.cfg.resume:
            return None
        if not self._looked:
            self._chosen, self._looked = find_intact(self.root), True
        return self._chosen

    def to_resume(self) -> Optional[dict[str, Any]]:
        """meta.json of the checkpoint `resume()` would load (read before loading anything), or None."""
        path = self._to_load()
        return None if path is None else read_meta(path)

    def resume(self) -> Optional[dict[str, Any]]:
        """Load the newest intact checkpoint when resuming is on (damaged ones are skipped, naming their
        files: `find_intact`); its `extra` state, or None."""
        path = self._to_load()
        if path is None:
            return None
        extra = load_checkpoint(self.trainer, path, critic=self.critic, verify=False)
        logger.info("resumed from %s: continuing after step %d", path, self.trainer.step)
        return extra

    def _due(self, steps_done: int, every: int, at_end: bool) -> bool:
        return (every > 0 and steps_done % every == 0) or (at_end and steps_done == self.total_steps)

    def save(self, steps_done: int, extra: dict[str, Any], metrics: Optional[dict[str, float]] = None,
             meta: Optional[dict[str, Any]] = None, with_critic: bool = True) -> Path:
        """A training checkpoint after `steps_done` steps, with this run's retention; `metrics` (the step's)
        are recorded for checkpoint.keep_best; `meta`: more meta.json fields (`to_resume`); `with_critic`
        False leaves the critic out (one not trained yet)."""
        cfg = self.cfg
        keep_best = KeepBest(cfg.keep_best, cfg.best_metric, cfg.best_mode) if cfg.keep_best else None
        start = time.perf_counter()
        path = save_checkpoint(self.trainer, self.root, steps_done, extra, self.run_config, keep_last=cfg.keep_last,
                               keep_every=cfg.keep_every, keep_best=keep_best, metrics=metrics,
                               critic=self.critic if with_critic else None, meta=meta)
        seconds = time.perf_counter() - start
        self.longest_save_s = max(self.longest_save_s or 0.0, seconds)
        return path

    def after_step(self, steps_done: int, extra: Callable[[], dict[str, Any]],
                   metrics: Optional[dict[str, float]] = None) -> None:
        """Save and/or export after `steps_done` optimizer steps, when configured to."""
        if self._due(steps_done, self.cfg.save_every, self.cfg.save_at_end):
            self.save(steps_done, extra(), metrics)
        if self._due(steps_done, self.cfg.hf_export_every, self.cfg.hf_export_at_end):
            self.trainer.gather_params()  # parallel.overlap_param_gather: the last step left the all-gather to do
            export_hf(self.trainer.module, self.trainer.groups, self.trainer.model_cfg,
                      self.hf_root / f"step_{steps_done:08d}", self.tokenizer,
                      max_shard_size=self.cfg.hf_max_shard_size)
