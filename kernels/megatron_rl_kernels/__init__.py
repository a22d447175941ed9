"""Fused kernels, each with a PyTorch reference (installed as `megatron_rl_kernels`; the
top-level name `kernels` belongs to another PyPI project).

- `fused_logprobs`: per-token log-probs / entropy of chosen tokens from hidden states and the
  vocab-parallel output weight without materialising [T, V] logits (Triton on CUDA, PyTorch
  elsewhere; `select` says which one a device gets).
- `topk_logprobs` / `logprobs_at`: the k likeliest tokens per position with their log-probs, and the
  differentiable log-probs of given tokens, from the same inputs without [T, V] logits (top-k
  logit distillation; PyTorch only).
"""

from __future__ import annotations

import torch

from .fused_logprobs import BACKENDS, fused_logprobs, naive_logprobs
from .topk_logprobs import logprobs_at, naive_logprobs_at, naive_topk_logprobs, topk_logprobs

__all__ = ["BACKENDS", "fused_logprobs", "logprobs_at", "naive_logprobs", "naive_logprobs_at", "naive_topk_logprobs",
           "select", "topk_logprobs"]


def select(device: torch.device) -> str:
    """The backend `fused_logprobs(backend="auto")` uses for tensors on `device`: "triton" on
    CUDA when triton imports, else "torch"."""
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        from .triton_logprobs import TritonBlockOps  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"
