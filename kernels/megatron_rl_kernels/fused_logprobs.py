"""Fused per-token log-probs (and entropy) of chosen tokens from hidden states and the
vocab-parallel output weight, without materialising the [T, V] logits.

`fused_logprobs(hidden [T, H], weight [V_local, H], targets [T]) -> (logprobs [T], entropy [T] | None)`
equals `log_softmax(hidden @ weight_full.T / temperature).gather(targets)` (and the entropy of the
same softmax), where `weight_full` is the concatenation of every tensor-parallel rank's shard.

How: a double loop over vocabulary chunks and token chunks. Each [chunk_tokens, chunk_vocab]
block of logits is computed, folded into per-token running statistics (max m, sum of
exp(l - m), and for entropy sum of exp(l - m) * (l - m)) by an online log-sum-exp, and freed.
Across tensor-parallel ranks the statistics are combined exactly as Megatron's
`vocab_parallel_cross_entropy` combines them: all-reduce MAX of m, then all-reduce SUM of
the rescaled sums and of the target logit (only the owning rank contributes it).
The backward recomputes each block's logits from the saved [T] log-normaliser and entropy and
accumulates grad_hidden [T, H] and grad_weight [V_local, H] block by block in fp32, from GEMMs in the
inputs' dtype (as the naive path's autograd).
Peak extra memory is a few [chunk_tokens, chunk_vocab] fp32 blocks plus O(T + T*H + chunk_vocab*H).

Numerics: each block's logits come from the same GEMM as the model's output layer, rounded to
`logits_dtype` (default: the input dtype) and divided by the temperature in that dtype, as
`output_layer(hidden) / temperature` does in the naive path; the softmax statistics, the gradient
of each block's logits and the accumulation over chunks are fp32, whatever the input dtype; the
block's logit gradient is rounded to the input dtype for the two backward GEMMs, as autograd does
in the naive path. In fp32 the result equals the naive path up to summation order.

Tensor parallelism: like Megatron's vocab-parallel cross entropy, the backward returns this
rank's contribution to grad_hidden (from its vocabulary shard). The caller feeds `hidden`
through Megatron's `copy_to_tensor_model_parallel_region` (or, with sequence parallelism,
`gather_from_sequence_parallel_region`), whose backward sums the contributions over the group,
exactly as the output layer (`ColumnParallelLinear`) does for its input.

The per-block softmax work is pluggable: `TorchBlockOps` (this module, any device) or
`kernels/megatron_rl_kernels/triton_logprobs.py` (CUDA + Triton); `fused_logprobs(..., backend="auto")` picks
Triton when the tensors are on a GPU and Triton imports, else the PyTorch reference.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.distributed as dist

Tensor = torch.Tensor

DEFAULT_CHUNK_TOKENS = 2048
DEFAULT_CHUNK_VOCAB = 8192
BACKENDS = ("auto", "torch", "triton")


class BlockOps(Protocol):
    """The per-block softmax work on one [t, v] block of pre-temperature logits `z` (the block
    is scratch: implementations may overwrite it).

    `local_targets` [t] are target indices relative to the block's first column; values
    outside [0, v) mean the target is in another block (or on another rank).
    """

    def stats(self, z: Tensor, local_targets: Tensor, temperature: float, with_entropy: bool
              ) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
        """(max m, sum exp(l - m), sum exp(l - m) * (l - m) or None, target logit or 0): fp32 [t]."""
        ...

    def grad(self, z: Tensor, local_targets: Tensor, temperature: float, logz: Tensor,
             entropy: Optional[Tensor], grad_logprobs: Optional[Tensor], grad_entropy: Optional[Tensor]) -> Tensor:
        """d loss / d z for the block: [t, v] in z's dtype."""
        ...


def _apply_temperature(z: Tensor, temperature: float) -> Tensor:
    """Logits as the naive path sees them: z / temperature in z's dtype, then fp32."""
    if temperature != 1.0:
        z = z / temperature
    return z.float()


def _target_mask(local_targets: Tensor, num_cols: int) -> tuple[Tensor, Tensor]:
    here = (local_targets >= 0) & (local_targets < num_cols)
    return here, torch.where(here, local_targets, torch.zeros_like(local_targets))


class TorchBlockOps:
    """PyTorch reference of the per-block softmax work (CPU and GPU). In-place where it can:
    at most two fp32 [t, v] temporaries live at once."""

    def stats(self, z, local_targets, temperature, with_entropy):
        logits = _apply_temperature(z, temperature)
        here, idx = _target_mask(local_targets, z.shape[1])
        target = logits.gather(1, idx[:, None])[:, 0]
        m = logits.max(dim=-1).values
        target = torch.where(here, target, torch.zeros_like(m))
        shifted = logits.sub_(m[:, None])
        exp = shifted.exp()
        s = exp.sum(dim=-1)
        b = torch.linalg.vecdot(exp, shifted) if with_entropy else None
        return m, s, b, target

    def grad(self, z, local_targets, temperature, logz, entropy, grad_logprobs, grad_entropy):
        logits = _apply_temperature(z, temperature)
        logp = logits.sub_(logz[:, None])
        p = logp.exp()
        # d logp_target / d l_j = 1[j = target] - p_j;  d H / d l_j = -p_j (log p_j + H)
        # so g = -p * (grad_logprobs + grad_entropy * (log p + H)) + 1[j = target] * grad_logprobs
        if grad_entropy is not None:
            coef = logp.add_(entropy[:, None]).mul_(grad_entropy[:, None])
            if grad_logprobs is not None:
                coef.add_(grad_logprobs[:, None])
            g = p.mul_(coef).neg_()
        else:
            g = p.mul_(-grad_logprobs[:, None])
        if grad_logprobs is not None:
            here, idx = _target_mask(local_targets, z.shape[1])
            g.scatter_add_(1, idx[:, None], torch.where(here, grad_logprobs, torch.zeros_like(grad_logprobs))[:, None])
        # Back through `.float()` and the division, in z's dtype (what autograd does in the naive path).
        g = g.to(z.dtype)
        return g / temperature if temperature != 1.0 else g


def _merge(m: Tensor, s: Tensor, b: Optional[Tensor], m2: Tensor, s2: Tensor, b2: Optional[Tensor]):
    """Combine two partial log-sum-exp statistics, each relative to its own max."""
    new_m = torch.maximum(m, m2)
    a1, a2 = (m - new_m).exp(), (m2 - new_m).exp()
    new_b = None
    if b is not None:
        new_b = a1 * (b + (m - new_m) * s) + a2 * (b2 + (m2 - new_m) * s2)
    return new_m, a1 * s + a2 * s2, new_b


def _combine_over_group(m: Tensor, s: Tensor, b: Optional[Tensor], target: Tensor, group
                        ) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """All-reduce this rank's statistics over the tensor-parallel group (Megatron's scheme)."""
    if group is None:
        return m, s, b, target
    global_m = m.clone()
    dist.all_reduce(global_m, op=dist.ReduceOp.MAX, group=group)
    scale = (m - global_m).exp()
    parts = [scale * s, target] + ([scale * (b + (m - global_m) * s)] if b is not None else [])
    summed = torch.stack(parts)
    dist.all_reduce(summed, group=group)
    return global_m, summed[0], (summed[2] if b is not None else None), summed[1]


def _block_logits(h: Tensor, w: Tensor, logits_dtype: torch.dtype) -> Tensor:
    """z = h @ w.T rounded to `logits_dtype` (fp32 accumulation in the GEMM either way)."""
    if logits_dtype == h.dtype:
        return h @ w.T
    return (h.float() @ w.float().T).to(logits_dtype)


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_start, temperature, chunk_tokens, chunk_vocab,
                with_entropy, logits_dtype, ops):
        num_tokens, num_vocab = hidden.shape[0], weight.shape[0]
        local_targets = targets - vocab_start
        m = s = b = None
        target = torch.zeros(num_tokens, dtype=torch.float32, device=hidden.device)
        for v0, v1 in _chunks(num_vocab, chunk_vocab):
            w = weight[v0:v1]
            cm, cs, cb, ct = [], [], [], []
            for t0, t1 in _chunks(num_tokens, chunk_tokens):
                z = _block_logits(hidden[t0:t1], w, logits_dtype)
                bm, bs, bb, bt = ops.stats(z, local_targets[t0:t1] - v0, temperature, with_entropy)
                cm.append(bm), cs.append(bs), cb.append(bb), ct.append(bt)
            chunk_m, chunk_s = torch.cat(cm), torch.cat(cs)
            chunk_b = torch.cat(cb) if with_entropy else None
            target += torch.cat(ct)
            if m is None:
                m, s, b = chunk_m, chunk_s, chunk_b
            else:
                m, s, b = _merge(m, s, b, chunk_m, chunk_s, chunk_b)
        m, s, b, target = _combine_over_group(m, s, b, target, group)
        logz = m + s.log()
        logprobs = target - logz
        entropy = s.log() - b / s if with_entropy else logprobs.new_empty(0)
        ctx.save_for_backward(hidden, weight, local_targets, logz, entropy if with_entropy else None)
        ctx.args = (temperature, chunk_tokens, chunk_vocab, logits_dtype, ops)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local_targets, logz, entropy = ctx.saved_tensors
        temperature, chunk_tokens, chunk_vocab, logits_dtype, ops = ctx.args
        if entropy is None:
            grad_entropy = None
        grad_logprobs = None if grad_logprobs is None else grad_logprobs.float()
        grad_entropy = None if grad_entropy is None else grad_entropy.float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprobs is None and grad_entropy is None) or not (need_h or need_w):
            return (None,) * 11
        num_tokens, num_vocab = hidden.shape[0], weight.shape[0]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_weight = torch.empty_like(weight) if need_w else None
        for v0, v1 in _chunks(num_vocab, chunk_vocab):
            w = weight[v0:v1]
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
            for t0, t1 in _chunks(num_tokens, chunk_tokens):
                h = hidden[t0:t1]
                z = _block_logits(h, w, logits_dtype)
                g = ops.grad(z, local_targets[t0:t1] - v0, temperature, logz[t0:t1],
                             None if entropy is None else entropy[t0:t1],
                             None if grad_logprobs is None else grad_logprobs[t0:t1],
                             None if grad_entropy is None else grad_entropy[t0:t1]).to(hidden.dtype)
                del z
                # The two gradient GEMMs in the inputs' dtype, as autograd runs the naive path's (bf16 on a GPU:
                # fp32 GEMMs made the backward 5x slower than the naive path's on an H200), each product
                # accumulated into the fp32 sums over chunks.
                if need_h:
                    grad_hidden[t0:t1] += g @ w
                if need_w:
                    grad_w += g.T @ h
            if need_w:
                grad_weight[v0:v1] = grad_w
        if need_h:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None


def _ops_for(backend: str, device: torch.device) -> BlockOps:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: use one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return TorchBlockOps()
    if device.type == "cuda":
        try:
            from .triton_logprobs import TritonBlockOps
        except ImportError:
            if backend == "triton":
                raise ImportError("the Triton log-prob kernel needs triton: pip install triton") from None
            return TorchBlockOps()
        return TritonBlockOps()
    if backend == "triton":
        raise ValueError(f"backend='triton' needs CUDA tensors, got tensors on {device}: use backend='auto' or 'torch'")
    return TorchBlockOps()


def fused_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, tp_group: Optional[dist.ProcessGroup] = None,
                   vocab_start: int = 0, temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                   chunk_vocab: int = DEFAULT_CHUNK_VOCAB, with_entropy: bool = False,
                   logits_dtype: Optional[torch.dtype] = None, backend: str = "auto"
                   ) -> tuple[Tensor, Optional[Tensor]]:
    """log p(targets) and optionally the softmax entropy per token, fp32 [T] each.

    hidden: [T, H]; weight: [V_local, H], rows `vocab_start .. vocab_start + V_local` of the
    full output weight (this tensor-parallel rank's shard; the whole weight without TP);
    targets: [T] indices into the full vocabulary; tp_group: the tensor-parallel group whose
    ranks hold the other shards (None: this rank holds the whole vocabulary).
    logits_dtype: what each block's logits are rounded to before the fp32 softmax (default:
    hidden's dtype, i.e. what an output layer in that dtype produces).
    backend: "auto" (Triton on CUDA when importable, else PyTorch), "torch" or "triton".
    Gradients flow to hidden and weight; grad_hidden is this rank's contribution (see module doc).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [T, H] and weight [V, H] expected, "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [T] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} and chunk_vocab={chunk_vocab} must be >= 1")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if tp_group is None and targets.numel() and not (
            int(targets.min()) >= vocab_start and int(targets.max()) < vocab_start + weight.shape[0]):
        raise ValueError(f"targets outside [{vocab_start}, {vocab_start + weight.shape[0]}) need the other "
                         "vocabulary shards: pass tp_group")
    if hidden.shape[0] == 0:  # no token (a context-parallel rank without targets of a row): the same on every
        # rank of tp_group, which holds the same tokens, so no collective is skipped by one rank alone
        empty = (hidden.sum() + weight.sum()).float().reshape(1)[:0] * 0.0  # in the graph, gradients of zero
        return empty, (empty.clone() if with_entropy else None)
    ops = _ops_for(backend, hidden.device)
    logprobs, entropy = _FusedLogprobs.apply(
        hidden, weight, targets.long(), tp_group, vocab_start, float(temperature), chunk_tokens, chunk_vocab,
        with_entropy, logits_dtype or hidden.dtype, ops)
    return logprobs, (entropy if with_entropy else None)


def naive_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """The materialising path (one process, whole vocabulary): full [T, V] logits, log_softmax,
    gather. Used as the comparison in tests and benchmarks."""
    logits = hidden @ weight.T
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    logprobs = logp.gather(1, targets.long()[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return logprobs, entropy
