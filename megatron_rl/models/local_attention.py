"""Core attention for the local (CPU) layer spec where Megatron-core's local one does not serve:
context parallelism, multi-latent attention, and packed rows.

Context parallelism is hand-written here because nothing upstream runs it on CPU: Megatron-core
supports it only in `TEDotProductAttention` (its local `DotProductAttention` asserts
`context_parallel_size == 1`), and Transformer Engine's ring attention needs CUDA.
`AllGatherContextAttention` takes the local attention's place when `parallel.cp > 1` without TE.
It is the all-gather variant of context parallelism: each rank's keys and values are all-gathered
over the context-parallel group (Megatron's sequence-parallel all-gather, whose backward
reduce-scatters the key/value gradients to their owners) and put in row order. The rank's queries
come in the chunks of `trainer.context_parallel`'s layout (chunks k and 2cp-1-k of every packed
segment); chunk k of a segment attends to the segment's chunks 0..k-1 in full and to itself
causally, read from the row's `cu_seqlens`, so no [S/cp, S] mask or score matrix is ever formed
and the blocks that the causal and document masks would zero (later chunks, other segments) are
never computed. The two blocks of a chunk are combined by their log-sum-exps (the online softmax
of blockwise attention). On CPU each block is one call of the flash-attention kernel that
`scaled_dot_product_attention` runs on CPU (`aten::_scaled_dot_product_flash_attention_for_cpu`,
called directly because it also returns the log-sum-exp), which tiles the block itself; its
backward (`..._for_cpu_backward`), given the merged output and log-sum-exp, gives each block's
share of the gradients, recomputing the probabilities tile by tile. What a layer keeps for the
backward pass is its queries, the gathered keys and values, the output and the log-sum-exps:
O(S/cp + S) rows of head width, nothing of size S/cp x S. Off CPU (the local spec on GPUs) the
blocks are plain tensor operations instead, which form one block's scores at a time.

Inputs come in THD layout (the trainer passes `PackedSeqParams(qkv_format="thd")` under
context parallelism, and Megatron's attention squeezes the batch dimension):
query [t, heads, d], key and value [t, groups, d]; the output is [t, heads * d].

Multi-latent attention (DeepSeek-V3) gives keys and values of different widths (`k_channels`,
`v_channels`), which Megatron-core's local `DotProductAttention` does not take (only TE's does):
`MaskedAttention` is its plain [s, b, heads, d] counterpart under the trainer's dense mask, and
`AllGatherContextAttention` takes both widths too (zero-padded to one width for the kernel).
gpt-oss's attention sinks (softmax_type "learnable") and sliding windows are `MaskedAttention`'s as
well: Megatron-core's local attention allocates its sinks on the CUDA device
(dot_product_attention.py:126-136), and its sliding-window mask replaces the trainer's packing mask
instead of joining it (fused_softmax.py:321-323).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megatron_rl.trainer.context_parallel import held_positions

Tensor = torch.Tensor


class _CoreAttention(MegatronModule):
    """What both take from Megatron's core-attention constructor (the arguments the attention layers
    build it with): no dropout, and the softmax scale (MLA's own, or 1/sqrt of the key width)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Optional[ProcessGroupCollection] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None):
        super().__init__(config=config)
        if config.attention_dropout and attention_dropout != 0.0:
            raise ValueError(f"{type(self).__name__} has no attention dropout (RL training runs without it)")
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.pg_collection = pg_collection


class AllGatherContextAttention(_CoreAttention):
    """Drop-in `core_attention` of Megatron's local spec for context-parallel training (module docstring).

    Inputs: query [t, heads, dk], key [t, groups, dk] and value [t, groups, dv] of this rank's positions
    (t = S/cp, in `trainer.context_parallel.held_positions` order) and `packed_seq_params.cu_seqlens_q`
    of the whole row; output [t, heads * dv].
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("context-parallel attention has no attention sinks or sliding windows")
        pg_collection = self.pg_collection
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Tensor:
        if query.dim() != 3 or packed_seq_params is None:
            raise ValueError("context-parallel attention takes THD inputs [t, heads, d] and the row's "
                             "PackedSeqParams (cu_seqlens of the whole row)")
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        cu_seqlens = packed_seq_params.cu_seqlens_q.cpu()
        gathered = torch.cat([held_positions(cu_seqlens, cp_size, r) for r in range(cp_size)])
        row_order = torch.argsort(gathered).to(key.device)  # gathered index of each row position
        key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=self.cp_group)
        key, value = key[row_order], value[row_order]
        v_width = value.shape[-1]
        if query.shape[-1] != v_width:  # multi-latent attention: zero columns change no score and add zero outputs
            width = max(query.shape[-1], v_width)
            query, key, value = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (query, key, value))
        blocks = _query_chunks(cu_seqlens.tolist(), cp_size, cp_rank)
        out = _ChunkedCausalAttention.apply(query, key, value, blocks, self.scale)[..., :v_width]
        return out.reshape(out.shape[0], -1)


def _query_chunks(bounds: list[int], cp_size: int, cp_rank: int) -> list[tuple[int, int, int, int]]:
    """This rank's query chunks, in its local order (that of `held_positions`), as (local start, row start
    of the chunk's segment, chunk index k in the segment, chunk length)."""
    chunks, local = [], 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = (end - start) // (2 * cp_size)
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            if length:
                chunks.append((local, start, k, length))
                local += length
    return chunks


class _ChunkedCausalAttention(torch.autograd.Function):
    """Causal attention of query chunks over the keys of their own segment, block by block.

    forward(query [t, heads, d], key and value [S, groups, d] in row order, chunks of `_query_chunks`,
    scale) -> [t, heads, d]. Each chunk k of length c at segment start s has two blocks: the keys
    s .. s + k c (all visible; none when k = 0) and its own c keys (causal). The backward pass
    recomputes each block's probabilities from the saved log-sum-exps."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, chunks: list, scale: float) -> Tensor:
        q, k, v = (_heads_first(x) for x in (query, key, value))
        out = torch.empty_like(query)
        lse = query.new_empty(1, query.shape[1], query.shape[0], dtype=torch.promote_types(query.dtype, torch.float32))
        out_h = _heads_first(out)
        for local, segment, index, length in chunks:
            rows, diagonal = slice(local, local + length), segment + index * length
            q_chunk = q[:, :, rows]
            o, l = _block_forward(q_chunk, k[:, :, diagonal:diagonal + length],
                                  v[:, :, diagonal:diagonal + length], True, scale)
            if index:  # the earlier chunks of the segment, merged by log-sum-exp
                o_before, l_before = _block_forward(q_chunk, k[:, :, segment:diagonal], v[:, :, segment:diagonal],
                                                    False, scale)
                merged = torch.logaddexp(l, l_before)
                o = (o * (l - merged).exp().unsqueeze(-1) + o_before * (l_before - merged).exp().unsqueeze(-1))
                l = merged
            out_h[:, :, rows] = o
            lse[:, :, rows] = l
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.chunks, ctx.scale = chunks, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor):
        query, key, value, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grads = [torch.zeros_like(x) for x in (query, key, value)]
        dq, dk, dv = (_heads_first(x) for x in grads)
        q, k, v, o, g = (_heads_first(x) for x in (query, key, value, out, grad_out))
        for local, segment, index, length in ctx.chunks:
            rows, diagonal = slice(local, local + length), segment + index * length
            blocks = [(diagonal, diagonal + length, True)] + ([(segment, diagonal, False)] if index else [])
            for first, last, causal in blocks:
                dq_block, dk_block, dv_block = _block_backward(
                    g[:, :, rows], q[:, :, rows], k[:, :, first:last], v[:, :, first:last], o[:, :, rows],
                    lse[:, :, rows], causal, ctx.scale)
                dq[:, :, rows] += dq_block
                dk[:, :, first:last] += dk_block
                dv[:, :, first:last] += dv_block
        return *grads, None, None


def _heads_first(x: Tensor) -> Tensor:
    """[t, heads, d] -> a [1, heads, t, d] view (the layout of scaled_dot_product_attention)."""
    return x.transpose(0, 1).unsqueeze(0)


def _block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of one block: q [1, heads, m, d] over k, v [1, groups, n, d] (causal: m = n, query i sees
    keys 0..i) -> (output [1, heads, m, d], log-sum-exp of the scaled scores [1, heads, m])."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return _plain_block_forward(q, k, v, causal, scale)


def _block_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of the gradients (dq, dk, dv) given the output and log-sum-exp of the whole softmax
    (all blocks of these queries): the flash-attention backward pass, per block."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    return _plain_block_backward(grad_out, q, k, v, out, lse, causal, scale)


def _plain_block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """`_block_forward` in plain tensor operations (the block's scores are formed), in at least fp32."""
    scores = _block_scores(q, k, causal, scale)
    lse = scores.logsumexp(-1)
    probs = (scores - lse.unsqueeze(-1)).exp()
    return torch.matmul(probs, _repeat_groups(v, q.shape[1]).to(probs.dtype)).to(q.dtype), lse


def _plain_block_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """`_block_backward` in plain tensor operations, in at least fp32."""
    heads, groups = q.shape[1], k.shape[1]
    probs = (_block_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp()
    grad_out, out = grad_out.to(probs.dtype), out.to(probs.dtype)
    dv = torch.matmul(probs.transpose(-1, -2), grad_out)
    dp = torch.matmul(grad_out, _repeat_groups(v, heads).to(probs.dtype).transpose(-1, -2))
    ds = probs * (dp - (grad_out * out).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, _repeat_groups(k, heads).to(probs.dtype))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(probs.dtype))
    dk, dv = (x.view(1, groups, heads // groups, *x.shape[2:]).sum(2) for x in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _block_scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(dtype), _repeat_groups(k, q.shape[1]).to(dtype).transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    return scores


def _repeat_groups(x: Tensor, heads: int) -> Tensor:
    """Grouped-query attention: [1, groups, n, d] -> [1, heads, n, d], each key/value head serving heads/groups
    query heads."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


class MaskedAttention(_CoreAttention):
    """Drop-in `core_attention` of Megatron's local spec for multi-latent attention and gpt-oss's attention
    without context parallelism: softmax(q k^T x scale, masked) v per head, with key and value widths of their
    own; optionally a learned sink logit per head in each softmax (`softmax_offset`, Megatron's name: its
    share of the probability mass goes nowhere) and a sliding window (query i sees keys i - left .. i, on top
    of the trainer's mask, in this layer when `config.window_attn_skip_freq` marks it).

    Inputs [s, b, heads, d] (query and key d = k_channels, value v_channels) and the trainer's dense
    mask [b or 1, 1, s, s] (True = masked out; None: causal); output [s, b, heads * v_channels].
    """

    def __init__(self, config: Any, layer_number: int, *args: Any, **kwargs: Any):
        super().__init__(config, layer_number, *args, **kwargs)
        if config.context_parallel_size != 1:
            raise ValueError("MaskedAttention does not split sequences: context parallelism uses "
                             "AllGatherContextAttention")
        self.window: Optional[int] = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(f"window_size={config.window_size}: causal attention sees no later keys (right = 0)")
            self.window = left
        self.softmax_offset: Optional[torch.nn.Parameter] = None
        if config.softmax_type == "learnable":
            tp = (self.pg_collection or ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])).tp
            heads = divide(config.num_attention_heads, tp.size())
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r}: MaskedAttention has vanilla and learnable")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The sinks split over TP ranks along the heads in distributed checkpoints, as Megatron-core's
        attentions save theirs (dot_product_attention.py:sharded_state_dict)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if self.softmax_offset is None:
            return {}
        tp = (self.pg_collection or ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])).tp
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=tp, dp_cp_group=metadata["dp_cp_group"])

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Tensor:
        if query.dim() != 4:
            raise ValueError("MaskedAttention takes [s, b, heads, d] inputs and a dense mask (THD layouts come "
                             "with context parallelism or Transformer Engine)")
        if key.shape[2] != query.shape[2]:  # grouped-query attention
            key = key.repeat_interleave(query.shape[2] // key.shape[2], dim=2)
            value = value.repeat_interleave(query.shape[2] // value.shape[2], dim=2)
        scores = torch.einsum("qbhd,kbhd->bhqk", query.float(), key.float()) * self.scale
        sq, sk = scores.shape[-2:]
        if attention_mask is None:
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(sk - sq + 1)
        if self.window is not None:  # the last queries are the last positions
            positions = torch.arange(sk, device=scores.device)
            distance = positions[sk - sq:, None] - positions  # query i is key position i + sk - sq
            attention_mask = attention_mask | (distance > self.window)
        scores = scores.masked_fill(attention_mask, float("-inf"))
        if self.softmax_offset is None:
            probs = torch.softmax(scores, dim=-1).to(value.dtype)
        else:
            sinks = self.softmax_offset.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1].to(value.dtype)
        out = torch.einsum("bhqk,kbhd->qbhd", probs, value)
        return out.reshape(out.shape[0], out.shape[1], -1)


class PackedAttention(_CoreAttention):
    """Drop-in `core_attention` of Megatron's local spec for packed rows on the CPU path: causal attention
    within each packed sample only, from the row's `cu_seqlens` (THD inputs, as TE's attention takes them on
    GPU).

    Megatron-core's local `DotProductAttention` takes a dense [S, S] mask instead, so it computes (and
    differentiates) all S^2 scores of a row of S tokens and masks those between samples away; RL rows
    pack many short samples, and those scores were most of a CPU training step (a row of 512 tokens
    holding ~17 samples of 30: 262k scores where the samples need 15k).

    Here the row's samples are grouped by length (`_length_groups`) and each group is one batched
    `scaled_dot_product_attention` call on its samples right-padded to the group's longest: causal
    attention never lets a sample's queries see the padding after it, and the padding's own outputs are
    dropped. One call per sample instead cost a kernel call and, in the backward pass, a zero-filled
    gradient of the whole row per sample (the backward of slicing it), which made a step's time grow
    with the square of the row's length (a 4096-token row of 256 samples: 3x the time of eight
    512-token rows). Padding within a group is bounded: a group's padded score count is at most twice its
    samples' own, and no sample is padded to more than twice its length (the padding at the row's end is
    one more sample; its outputs feed nothing).

    Inputs: query [t, heads, d], key and value [t, groups, d] and `packed_seq_params.cu_seqlens_q`;
    output [t, heads * d].
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> Tensor:
        if query.dim() != 3 or packed_seq_params is None:
            raise ValueError("PackedAttention takes THD inputs [t, heads, d] and the row's PackedSeqParams")
        # Every layer of a forward gets the same PackedSeqParams: the plan is made once per row
        plan = getattr(packed_seq_params, "_packed_attention_plan", None)
        if plan is None or plan[0] != query.device:
            plan = (query.device, _packed_plan(packed_seq_params.cu_seqlens_q.tolist(), query.device))
            packed_seq_params._packed_attention_plan = plan
        groups, order = plan[1]
        if not groups:
            return query.new_zeros(0, query.shape[1] * value.shape[-1])
        gqa = query.shape[1] != key.shape[1]
        outputs = []
        for index, keep in groups:  # index: [n, L] row positions, the padding repeating a sample's last token
            n, length = index.shape
            q, k, v = (x.index_select(0, index.reshape(-1)).view(n, length, *x.shape[1:]).transpose(1, 2)
                       for x in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                                   enable_gqa=gqa)  # [n, heads, L, d]
            out = out.transpose(1, 2).reshape(n * length, out.shape[1], out.shape[-1])
            outputs.append(out if keep is None else out.index_select(0, keep))
        out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        if order is not None:  # the groups' tokens back in row order
            out = out.index_select(0, order)
        return out.reshape(out.shape[0], -1)


def _length_groups(lengths: list[int], slack: float = 2.0) -> list[list[int]]:
    """The samples (indices into `lengths`, all > 0) in groups of one batched attention call each: longest
    first, a group takes the next sample while the group's longest is at most `slack` x its length and the
    group's padded score count (members x longest^2) stays within `slack` x the members' own (the sum of
    their squared lengths). The first bound keeps a long sample from taking a short one along (two members
    always pass the second: 2 L^2 <= 2 (L^2 + l^2))."""
    groups: list[list[int]] = []
    longest = squares = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        size = lengths[i]
        if groups and longest <= slack * size and (len(groups[-1]) + 1) * longest**2 <= slack * (squares + size**2):
            groups[-1].append(i)
            squares += size**2
        else:
            groups.append([i])
            longest, squares = size, size**2
    return groups


def _packed_plan(bounds: list[int], device: torch.device):
    """For a row's sample bounds (cu_seqlens): [(gather index [n, L] of a group's samples right-padded to
    its longest, the flat positions of their real tokens in the group's [n * L] output, or None when none
    is padding)], and the permutation that puts the groups' tokens back in row order (None if they are
    in order already)."""
    pairs = [(a, b - a) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if not pairs:
        return [], None
    starts = torch.tensor([a for a, _ in pairs])
    lengths = torch.tensor([n for _, n in pairs])
    groups, positions = [], []
    for members in _length_groups(lengths.tolist()):
        chosen = torch.tensor(members)
        size = lengths[chosen][:, None]  # [n, 1]
        steps = torch.arange(int(size[0, 0]))[None, :]  # the group's longest first
        index = starts[chosen][:, None] + torch.minimum(steps, size - 1)  # padding repeats the last token
        real = (steps < size).reshape(-1)
        keep = None if bool(real.all()) else real.nonzero().squeeze(1).to(device)
        groups.append((index.to(device), keep))
        positions.append(index.reshape(-1)[real])
    flat = torch.cat(positions)
    order = None
    if not torch.equal(flat, torch.arange(flat.numel())):
        order = torch.empty_like(flat)
        order[flat] = torch.arange(flat.numel())
        order = order.to(device)
    return groups, order
