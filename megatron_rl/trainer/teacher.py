"""The distillation teacher (algorithm.distill.teacher): a frozen model of its own architecture, read from an HF
checkpoint, that scores the student's samples (log-probs of the sampled tokens) and holds no accelerator memory
between those forwards.

It is a `Trainer` (same parallel layout, packing and log-prob code as the policy, so its numbers mean the same
thing) that never takes an optimizer step: only its parameters come onto the device, for `score`, the way a
weight sync brings them (`onload_weights_for_sync`), and they leave again right after.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)


def teacher_model_config(student: Any, path: str) -> Any:
    """The teacher's `ModelConfig`: the architecture its config.json gives (any family and size), on the
    student's tokenizer, dtype, attention implementation and log-prob path; no LoRA, no recomputation (it
    only runs forwards). Raises ValueError for a config.json this build cannot run."""
    from megatron_rl.checkpoint.hf import arch_from_hf_config
    from megatron_rl.config.model import ModelConfig

    arch = arch_from_hf_config(path)
    return ModelConfig(name=f"teacher:{Path(path).name}", path=str(path), tokenizer=student.tokenizer,
                       trust_remote_code=student.trust_remote_code, dtype=student.dtype,
                       transformer_impl=student.transformer_impl, fused_logprobs=student.fused_logprobs,
                       **arch)


class Teacher:
    """The frozen teacher of on-policy distillation; `score` gives its log-probs of samples' targets."""

    def __init__(self, model_cfg: Any, optim_cfg: Any, groups: Any, options: Any) -> None:
        from megatron_rl.trainer.core import Trainer

        # routing replay is the policy's affair: the teacher's routers (if any) choose freely
        self.model_cfg = model_cfg
        self.trainer = Trainer(model_cfg, optim_cfg, groups, dataclasses.replace(options, routing_replay=False))
        self.trainer.load_hf(model_cfg.path)
        for param in self.trainer.module.parameters():
            param.requires_grad_(False)  # never trained: nothing may step it by mistake
        self.trainer.offload()  # between forwards it lives in host memory

    def score(self, samples: Sequence[Any]) -> list:
        """Log-probs [L-1] of each sample's targets under the teacher (every rank gets every sample's), at
        the trainer options' logprob_temperature like the policy's. Only the parameters visit the device."""
        self.trainer.onload_weights_for_sync()
        try:
            logprobs, _ = self.trainer.forward_logprobs(samples)
        finally:
            self.trainer.offload_weights_after_sync()
        return logprobs
