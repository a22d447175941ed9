"""The distillation teacher (algorithm.distill.teacher): a frozen model of its own architecture, read from an HF
checkpoint, that scores the student's samples (log-probs of the sampled tokens, and with the topk estimator its k
likeliest tokens at each position) and holds no accelerator memory between those forwards.

It is a `Trainer` (same parallel layout, packing and log-prob code as the policy, so its numbers mean the same
thing) that never takes an optimizer step: only its parameters come onto the device, for `score`, the way a
weight sync brings them (`onload_weights_for_sync`), and they leave again right after. Its `ModelConfig` comes
from megatron_rl/config/teacher.py.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

logger = logging.getLogger(__name__)


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
        if groups.rank == 0:
            plan = self.trainer.memory_plan()
            logger.info("distillation teacher %s: %s, %d layers, width %d; this rank's parameters %.1f MB (on the "
                        "device only for its forward), gradient buffer %.1f MB (never written)", model_cfg.path,
                        model_cfg.family, model_cfg.num_layers, model_cfg.hidden_size, plan["params"] / 2**20,
                        plan["grads"] / 2**20)

    def score(self, samples: Sequence[Any]) -> list:
        """Log-probs [L-1] of each sample's targets under the teacher (every rank gets every sample's), at
        the trainer options' logprob_temperature like the policy's; at the targets of each sample's loss mask only
        (NaN at the others). Only the parameters visit the device."""
        self.trainer.onload_weights_for_sync()
        try:
            logprobs, _ = self.trainer.forward_logprobs(samples, loss_targets_only=True)
        finally:
            self.trainer.offload_weights_after_sync()
        return logprobs

    def score_topk(self, samples: Sequence[Any], k: int, vocab_limit: int) -> list:
        """Per sample (every rank gets every sample's): the teacher's log-probs of its targets [L-1], and its k
        likeliest tokens below `vocab_limit` (the student's vocabulary) at each target position, ids [L-1, k] and
        log-probs [L-1, k] under its softmax over its whole vocabulary (Trainer.forward_topk)."""
        self.trainer.onload_weights_for_sync()
        try:
            return self.trainer.forward_topk(samples, k, vocab_limit=vocab_limit)
        finally:
            self.trainer.offload_weights_after_sync()
