"""Log-probs of several tokens per position from hidden states and the vocab-parallel output weight, without
materialising the [T, V] logits: the teacher's top-k tokens (`topk_logprobs`, forward only) and the student's
log-probs of given tokens with their gradient (`logprobs_at`). Top-k logit distillation needs both
(megatron_rl/algorithms/distill.py); `fused_logprobs` takes one target per position and has no top-k.

`topk_logprobs(hidden [T, H], weight [V_local, H], targets [T], k)` -> (log p(targets) [T], ids [T, k],
log p(ids) [T, k]): the k likeliest tokens of `log_softmax(hidden @ weight_full.T / temperature)` at each position,
most likely first, and the log-prob of the position's target under the same softmax.
`logprobs_at(hidden, weight, ids [T, K])` -> log p(ids) [T, K], differentiable in hidden and weight.

How: the tokens are taken in chunks of `chunk_tokens`; each chunk's [chunk, V_local] logits are formed once (the
logits' GEMM rounded to the inputs' dtype and divided by the temperature, then fp32, as `fused_logprobs` and the
naive path do), reduced to per-token statistics (max, sum of exp, the wanted logits; `topk` of the local shard) and
freed. Across tensor-parallel ranks the log-normaliser is combined as Megatron's `vocab_parallel_cross_entropy`
combines it (all-reduce MAX, then SUM of the rescaled sums); a wanted token's logit comes from the one rank whose
shard holds it (all-reduce SUM of the others' zeros); the top-k of the whole vocabulary is the top-k of every rank's
local top-k (all-gather of [T, k] values and ids). `logprobs_at`'s backward recomputes the logits block by block
(`chunk_vocab` columns by `chunk_tokens` tokens, by default as many as fit BLOCK_ELEMENTS) from the saved [T]
log-normaliser: d log p(id_j) / d l_v = 1[v = id_j] - p_v, so with g [T, K] the upstream gradient the logits'
gradient is scatter(g) - p * sum_j g_j; then grad_hidden += g_l @ w, grad_weight[chunk] += g_l.T @ h (GEMMs in the
inputs' dtype, accumulated in fp32 one vocabulary chunk at a time, as `fused_logprobs` does). Like `fused_logprobs`,
grad_hidden is this rank's contribution from its vocabulary shard; the caller sums it over the tensor-parallel group
(Megatron's `copy_to_tensor_model_parallel_region`, or the sequence-parallel gather, in front of `hidden`).

Peak extra memory: a few fp32 blocks of BLOCK_ELEMENTS, an fp32 [T, H] and [chunk_vocab, H] for the backward's
sums, the gradient of the weight in its dtype, plus O(T * K). PyTorch only (any device); there is no Triton
version.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .fused_logprobs import DEFAULT_CHUNK_VOCAB, _apply_temperature, _block_logits, _chunks

Tensor = torch.Tensor

BLOCK_ELEMENTS = 1 << 24  # fp32 logits per chunk (64 MiB): chunk_tokens = BLOCK_ELEMENTS // V_local by default


def _chunk_tokens(chunk_tokens: Optional[int], num_vocab: int) -> int:
    if chunk_tokens is None:
        return max(1, BLOCK_ELEMENTS // max(num_vocab, 1))
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    return chunk_tokens


def _check(hidden: Tensor, weight: Tensor, temperature: float) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [T, H] and weight [V, H] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")


def _logz_over_group(m: Tensor, s: Tensor, group) -> tuple[Tensor, Tensor]:
    """(global max, global sum of exp(l - global max)) from this rank's [T] statistics."""
    if group is None:
        return m, s
    global_m = m.clone()
    dist.all_reduce(global_m, op=dist.ReduceOp.MAX, group=group)
    s = s * (m - global_m).exp()
    dist.all_reduce(s, group=group)
    return global_m, s


def _local_columns(ids: Tensor, vocab_start: int, num_vocab: int) -> tuple[Tensor, Tensor]:
    """(here [.., K] bool: this shard holds the token, columns [.., K]: its column here, 0 elsewhere)."""
    local = ids - vocab_start
    here = (local >= 0) & (local < num_vocab)
    return here, torch.where(here, local, torch.zeros_like(local))


@torch.no_grad()
def topk_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, k: int, tp_group: Optional[dist.ProcessGroup] = None,
                  vocab_start: int = 0, temperature: float = 1.0, vocab_limit: Optional[int] = None,
                  chunk_tokens: Optional[int] = None, logits_dtype: Optional[torch.dtype] = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(log p(targets) [T] fp32, ids [T, k] int64, log p(ids) [T, k] fp32, most likely first) under the softmax of
    the whole vocabulary (every rank of `tp_group` holds a shard of `weight`; `vocab_start` is this rank's first
    row). vocab_limit: only ids below it are candidates (tokens another model cannot represent); they still count
    in the normaliser, so their probability is what the top k leave over. No gradient."""
    _check(hidden, weight, temperature)
    num_tokens, num_vocab = hidden.shape[0], weight.shape[0]
    total = num_vocab * (1 if tp_group is None else dist.get_world_size(tp_group))
    limit = total if vocab_limit is None else min(vocab_limit, total)
    if not 1 <= k <= limit:
        raise ValueError(f"k={k} must be in [1, {limit}] (the candidate tokens: vocabulary {total}"
                         + (f", vocab_limit {vocab_limit})" if vocab_limit is not None else ")"))
    if targets.shape != (num_tokens,):
        raise ValueError(f"targets must be [T] = [{num_tokens}], got {tuple(targets.shape)}")
    dtype = logits_dtype or hidden.dtype
    local_k = min(k, num_vocab)
    here, columns = _local_columns(targets.long(), vocab_start, num_vocab)
    m = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
    s, target = torch.empty_like(m), torch.zeros_like(m)
    values = torch.empty(num_tokens, local_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(num_tokens, local_k, dtype=torch.long, device=hidden.device)
    candidate = torch.arange(vocab_start, vocab_start + num_vocab, device=hidden.device) < limit
    for t0, t1 in _chunks(num_tokens, _chunk_tokens(chunk_tokens, num_vocab)):
        logits = _apply_temperature(_block_logits(hidden[t0:t1], weight, dtype), temperature)
        target[t0:t1] = torch.where(here[t0:t1], logits.gather(1, columns[t0:t1, None])[:, 0], 0.0)
        m[t0:t1] = logits.max(dim=-1).values
        s[t0:t1] = (logits - m[t0:t1, None]).exp().sum(dim=-1)
        top = logits.masked_fill(~candidate, -torch.inf).topk(local_k, dim=-1)
        values[t0:t1], ids[t0:t1] = top.values, top.indices + vocab_start
        del logits
    m, s = _logz_over_group(m, s, tp_group)
    if tp_group is not None:
        dist.all_reduce(target, group=tp_group)
        size = dist.get_world_size(tp_group)
        every_value = [torch.empty_like(values) for _ in range(size)]
        every_id = [torch.empty_like(ids) for _ in range(size)]
        dist.all_gather(every_value, values, group=tp_group)
        dist.all_gather(every_id, ids, group=tp_group)
        values, ids = torch.cat(every_value, dim=1), torch.cat(every_id, dim=1)
    top = values.topk(k, dim=-1)  # -inf (a non-candidate) only where fewer than k candidates: excluded above
    logz = m + s.log()
    return target - logz, ids.gather(1, top.indices), top.values - logz[:, None]


class _LogprobsAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, group, vocab_start, temperature, chunk_tokens, chunk_vocab, logits_dtype):
        num_tokens, num_vocab = hidden.shape[0], weight.shape[0]
        here, columns = _local_columns(ids, vocab_start, num_vocab)
        m = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        s = torch.empty_like(m)
        picked = torch.zeros(ids.shape, dtype=torch.float32, device=hidden.device)
        for t0, t1 in _chunks(num_tokens, _chunk_tokens(chunk_tokens, num_vocab)):
            logits = _apply_temperature(_block_logits(hidden[t0:t1], weight, logits_dtype), temperature)
            picked[t0:t1] = torch.where(here[t0:t1], logits.gather(1, columns[t0:t1]), 0.0)
            m[t0:t1] = logits.max(dim=-1).values
            s[t0:t1] = (logits - m[t0:t1, None]).exp().sum(dim=-1)
            del logits
        m, s = _logz_over_group(m, s, group)
        if group is not None:
            dist.all_reduce(picked, group=group)
        logz = m + s.log()
        ctx.save_for_backward(hidden, weight, here, columns, logz)
        ctx.args = (temperature, chunk_tokens, chunk_vocab, logits_dtype)
        return picked - logz[:, None]

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, here, columns, logz = ctx.saved_tensors
        temperature, chunk_tokens, chunk_vocab, logits_dtype = ctx.args
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return (None,) * 9
        scattered = torch.where(here, grad_out.float(), 0.0)  # g_j, on the shard that holds id_j
        total = grad_out.float().sum(dim=-1)
        num_tokens, num_vocab = hidden.shape[0], weight.shape[0]
        # vocabulary chunks outside, token chunks inside (as fused_logprobs): the fp32 sums are one chunk of
        # grad_weight at a time, never a whole [V_local, H] copy of it
        block_tokens = chunk_tokens or max(1, BLOCK_ELEMENTS // max(min(chunk_vocab, num_vocab), 1))
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_weight = torch.empty_like(weight) if need_w else None
        for v0, v1 in _chunks(num_vocab, chunk_vocab):
            w = weight[v0:v1]
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
            in_chunk = here & (columns >= v0) & (columns < v1)
            for t0, t1 in _chunks(num_tokens, block_tokens):
                h = hidden[t0:t1]
                logits = _apply_temperature(_block_logits(h, w, logits_dtype), temperature)
                g = logits.sub_(logz[t0:t1, None]).exp_().mul_(-total[t0:t1, None])  # -p_v * sum_j g_j
                mine = in_chunk[t0:t1]
                g.scatter_add_(1, torch.where(mine, columns[t0:t1] - v0, 0),  # + g_j at id_j (ids in this chunk)
                               torch.where(mine, scattered[t0:t1], 0.0))
                g = g.to(hidden.dtype)
                if temperature != 1.0:
                    g = g / temperature
                if need_h:
                    grad_hidden[t0:t1] += g @ w
                if need_w:
                    grad_w += g.T @ h
                del logits, g
            if need_w:
                grad_weight[v0:v1] = grad_w
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight,
                None, None, None, None, None, None, None)


def logprobs_at(hidden: Tensor, weight: Tensor, ids: Tensor, tp_group: Optional[dist.ProcessGroup] = None,
                vocab_start: int = 0, temperature: float = 1.0, chunk_tokens: Optional[int] = None,
                chunk_vocab: int = DEFAULT_CHUNK_VOCAB, logits_dtype: Optional[torch.dtype] = None) -> Tensor:
    """log p(ids) [T, K] fp32 under the softmax of the whole vocabulary (`weight` is this rank's shard, rows
    `vocab_start ..`; the other shards are on the other ranks of `tp_group`), differentiable in hidden and weight
    (grad_hidden: this rank's contribution, see the module docstring). ids [T, K]: indices into the whole
    vocabulary."""
    _check(hidden, weight, temperature)
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids must be [T, K] with T = {hidden.shape[0]}, got {tuple(ids.shape)}")
    total = weight.shape[0] * (1 if tp_group is None else dist.get_world_size(tp_group))
    if ids.numel():
        low, high = torch.stack([ids.min(), ids.max()]).tolist()  # one device sync, not two
        if low < 0 or high >= total:
            raise ValueError(f"ids must lie in [0, {total}) (the vocabulary), got [{low}, {high}]")
    if hidden.shape[0] == 0:  # no token here: the same on every rank of tp_group (they hold the same tokens)
        return (hidden.sum() + weight.sum()).float().reshape(1, 1)[:0].expand(0, ids.shape[1]) * 0.0
    _chunk_tokens(chunk_tokens, weight.shape[0])  # refuses chunk_tokens < 1
    if chunk_vocab < 1:
        raise ValueError(f"chunk_vocab={chunk_vocab} must be >= 1")
    return _LogprobsAt.apply(hidden, weight, ids.long(), tp_group, vocab_start, float(temperature),
                             chunk_tokens, chunk_vocab, logits_dtype or hidden.dtype)


def naive_topk_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, k: int, temperature: float = 1.0,
                        vocab_limit: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The materialising reference of `topk_logprobs` (one process, whole vocabulary)."""
    logp = torch.log_softmax((hidden @ weight.T / temperature).float(), dim=-1)
    candidates = logp if vocab_limit is None else logp[:, :vocab_limit]
    top = candidates.topk(k, dim=-1)
    return logp.gather(1, targets.long()[:, None])[:, 0], top.indices, top.values


def naive_logprobs_at(hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """The materialising reference of `logprobs_at` (one process, whole vocabulary)."""
    return torch.log_softmax((hidden @ weight.T / temperature).float(), dim=-1).gather(1, ids.long())
