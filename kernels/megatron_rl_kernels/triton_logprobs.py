"""Triton version of the per-block softmax work of `fused_logprobs` (CUDA only).

Validated on one H200 (2026-12-04, torch 2.11 + CUDA 13.0, triton 3.6.0):
`tests/gpu/test_fused_logprobs_gpu.py` passed there (equal to the PyTorch reference, `TorchBlockOps`,
forward and backward, fp32 and bf16, with and without a temperature, on a vocabulary shard; peak
memory). Elsewhere it runs in Triton's CPU interpreter (TRITON_INTERPRET=1,
`tests/unit/test_fused_logprobs.py`), which truncates fp32 -> bf16 instead of rounding to nearest.
`fused_logprobs(backend="torch")` bypasses it.

Structure: `fused_logprobs.py` drives the same double loop over vocabulary and token chunks for
both backends and computes each block's logits with the same GEMM (cuBLAS on GPU); this module
replaces only the per-block softmax work, with one program per token row streaming over the
row in BLOCK_V tiles with an online softmax (running max m, sum of exp(l - m) and, for
entropy, sum of exp(l - m) * (l - m)), so a block needs no fp32 temporaries, and the backward
writes the gradient over the block in place. Rounding follows `TorchBlockOps` exactly: the
temperature divides in the block's dtype, everything else is fp32.

Imported only by `fused_logprobs._ops_for` when tensors are on CUDA, so machines without
triton never import it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor

_MAX_BLOCK_V = 2048
_NUM_WARPS = 8


@triton.jit
def _load_logits(row_ptr, cols, mask, temperature, HAS_TEMPERATURE: tl.constexpr):
    """fp32 logits of one tile as the naive path sees them; masked lanes are -inf."""
    z = tl.load(row_ptr + cols, mask=mask, other=float("-inf"))
    if HAS_TEMPERATURE:  # z / temperature rounded to z's dtype, as torch divides a bf16 tensor
        z = (z.to(tl.float32) / temperature).to(row_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    return z.to(tl.float32)


@triton.jit
def _stats_kernel(z_ptr, z_stride, targets_ptr, m_ptr, s_ptr, b_ptr, t_ptr, num_cols, temperature,
                  HAS_TEMPERATURE: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * z_stride
    target = tl.load(targets_ptr + row)
    m = float("-inf")
    s = 0.0
    b = 0.0
    for start in range(0, num_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < num_cols
        x = _load_logits(row_ptr, cols, mask, temperature, HAS_TEMPERATURE)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.exp(m - new_m)  # 0 on the first tile (m = -inf)
        e = tl.exp(x - new_m)  # 0 on masked lanes
        if WITH_ENTROPY:
            d = tl.where(mask, x - new_m, 0.0)
            # (m - new_m) * s is -inf * 0 on the first tile: keep it out.
            b = alpha * (b + tl.where(s > 0, (m - new_m) * s, 0.0)) + tl.sum(e * d, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = new_m
    here = (target >= 0) & (target < num_cols)
    t = _load_logits(row_ptr, tl.where(here, target, 0), here, temperature, HAS_TEMPERATURE)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(t_ptr + row, tl.where(here, t, 0.0))
    if WITH_ENTROPY:
        tl.store(b_ptr + row, b)


@triton.jit
def _grad_kernel(z_ptr, z_stride, targets_ptr, logz_ptr, entropy_ptr, glp_ptr, gent_ptr, num_cols, temperature,
                 HAS_TEMPERATURE: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """Overwrite the block with d loss / d z:
    g = -p * (g_lp + g_ent * (log p + H)) + 1[j = target] * g_lp, then back through the
    fp32 cast and the temperature in z's dtype."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = z_ptr + row * z_stride
    target = tl.load(targets_ptr + row)
    logz = tl.load(logz_ptr + row)
    glp = 0.0
    if HAS_GLP:
        glp = tl.load(glp_ptr + row)
    gent = 0.0
    ent = 0.0
    if HAS_GENT:
        gent = tl.load(gent_ptr + row)
        ent = tl.load(entropy_ptr + row)
    for start in range(0, num_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < num_cols
        logp = _load_logits(row_ptr, cols, mask, temperature, HAS_TEMPERATURE) - logz
        p = tl.exp(logp)
        coef = glp + gent * (logp + ent)
        g = -p * coef
        if HAS_GLP:
            g = tl.where(cols == target, g + glp, g)
        g = g.to(z_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        if HAS_TEMPERATURE:
            g = (g.to(tl.float32) / temperature).to(z_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(row_ptr + cols, g, mask=mask)  # masked lanes (nan) are never stored


def _block_v(num_cols: int) -> int:
    return min(triton.next_power_of_2(max(num_cols, 16)), _MAX_BLOCK_V)


def _check_block(z: Tensor) -> None:
    # Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors: used by the unit tests.
    on_device = z.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    assert on_device and z.dim() == 2 and z.stride(1) == 1, "blocks are row-major CUDA tensors"


class TritonBlockOps:
    """`fused_logprobs.BlockOps` in Triton: same inputs, same outputs, same rounding."""

    def stats(self, z: Tensor, local_targets: Tensor, temperature: float, with_entropy: bool
              ) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
        _check_block(z)
        rows, cols = z.shape
        m, s, t = (torch.empty(rows, dtype=torch.float32, device=z.device) for _ in range(3))
        b = torch.empty(rows, dtype=torch.float32, device=z.device) if with_entropy else m
        _stats_kernel[(rows,)](
            z, z.stride(0), local_targets.contiguous(), m, s, b, t, cols, float(temperature),
            HAS_TEMPERATURE=temperature != 1.0, WITH_ENTROPY=with_entropy, BLOCK_V=_block_v(cols),
            num_warps=_NUM_WARPS)
        return m, s, (b if with_entropy else None), t

    def grad(self, z: Tensor, local_targets: Tensor, temperature: float, logz: Tensor, entropy: Optional[Tensor],
             grad_logprobs: Optional[Tensor], grad_entropy: Optional[Tensor]) -> Tensor:
        _check_block(z)
        rows, cols = z.shape
        has_gent = grad_entropy is not None
        _grad_kernel[(rows,)](
            z, z.stride(0), local_targets.contiguous(), logz.contiguous(),
            entropy.contiguous() if has_gent else logz,
            grad_logprobs.contiguous() if grad_logprobs is not None else logz,
            grad_entropy.contiguous() if has_gent else logz,
            cols, float(temperature),
            HAS_TEMPERATURE=temperature != 1.0, HAS_GLP=grad_logprobs is not None, HAS_GENT=has_gent,
            BLOCK_V=_block_v(cols), num_warps=_NUM_WARPS)
        return z
