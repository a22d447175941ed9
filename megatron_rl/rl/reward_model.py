"""A discriminative reward model served in the job: a `*ForSequenceClassification` checkpoint run as a Megatron
model in the trainer's processes, scoring token sequences.

The model is a `Trainer(head="value")` (the critic's machinery: same parallel layout as the policy, same
packing, same forward) loaded by checkpoint/reward_model.py. Its weights live off the accelerator except
during `score`, as the reference policy's and the critic's do between their uses. `score` is a collective:
every rank calls it with the same sequences and gets every score.

The score of a sequence is transformers' (`*ForSequenceClassification.forward`): the head's output at the
last token that is not the checkpoint's pad token (config.json pad_token_id; without one, the last token),
so a response whose eos is the pad token is scored at the token before it, as transformers does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)


def last_scored_index(tokens: Sequence[int], pad_token_id: Optional[int]) -> int:
    """Where transformers reads a sequence's score: the last position whose token is not `pad_token_id`
    (0 when every token is; the last position when there is no pad token)."""
    if pad_token_id is None:
        return len(tokens) - 1
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] != pad_token_id:
            return i
    return 0


class RewardModel:
    """The reward model at `path`, built at the policy's parallel layout (see the module docstring)."""

    def __init__(self, path: str, policy_model_cfg: Any, optim_cfg: Any, groups: Any, options: Any) -> None:
        from megatron_rl.checkpoint.reward_model import load_reward_model, reward_model_config
        from megatron_rl.config.reward_model import reward_model_arch
        from megatron_rl.trainer.core import Trainer

        self.path = path
        self.pad_token_id = reward_model_config(path).get("pad_token_id")
        arch = reward_model_arch(path, policy_model_cfg)
        # one more position than the policy's samples: the score of a sample's last token is the output at that
        # token, which the trainer reports as the "value" of a target after it (a padding token, see `score`)
        options = dataclasses.replace(options, micro_batch_tokens=options.micro_batch_tokens + 1,
                                      routing_replay=False, pad_token_id=self.pad_token_id or 0)
        self.trainer = Trainer(arch, optim_cfg, groups, options, head="value")
        load_reward_model(self.trainer.module, path, arch, groups)
        self.trainer.optimizer.reload_model_params()
        self.trainer.offload()  # idle until the first scoring
        self.calls = 0
        self.seconds = 0.0

    def score(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence (prompt + response ids), on every rank: onload, one forward, offload."""
        import torch

        from megatron_rl.trainer.packing import Sample

        if not sequences:
            return []
        start = time.perf_counter()
        pad = self.pad_token_id or 0
        # entry t of the values is the head's output at token t: a sample of n tokens plus one appended token has
        # n targets, so every token's output is there (causal attention: the appended one changes none of them)
        samples = [Sample(torch.tensor([*seq, pad], dtype=torch.long), torch.ones(len(seq))) for seq in sequences]
        self.trainer.onload()
        try:
            values, _ = self.trainer.forward_logprobs(samples)
        finally:
            self.trainer.offload()
        self.calls += 1
        self.seconds += time.perf_counter() - start
        return [float(v[last_scored_index(seq, self.pad_token_id)]) for seq, v in zip(sequences, values)]
