"""Independent references the tests compare the project against: transformers' own forward, teacher-forced."""

from __future__ import annotations

from typing import Sequence

import torch


def teacher_forced_logprobs(model: torch.nn.Module, sequences: Sequence[torch.Tensor],
                            entropies: bool = False) -> list:
    """Per sequence, the log-prob transformers' `model` gives each next token (positions 1..), in float64 after
    the logits; with `entropies`, (log-probs, the entropy of each position's distribution)."""
    out = []
    for seq in sequences:
        with torch.no_grad():
            logp = torch.log_softmax(model(seq[None]).logits[0, :-1].double(), -1)
        chosen = logp.gather(-1, seq[1:, None])[:, 0]
        out.append((chosen, -(logp.exp() * logp).sum(-1)) if entropies else chosen)
    return out
