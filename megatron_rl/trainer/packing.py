"""Sequence packing: variable-length samples -> micro-batches of one packed row under a token budget.

Samples are placed into as few rows of at most `token_budget` tokens as first-fit decreasing finds,
balanced between them (`assign_rows`). Each
row carries restarted position ids, `cu_seqlens` for THD-format attention (Transformer Engine
on GPU; context parallelism) and, unless `dense_mask=False`, a block-diagonal causal mask
(local attention on CPU). All rows of one call are padded to the same length, a multiple of
`pad_multiple` (tensor-parallel size for sequence parallelism), so pipeline stages exchange
equal shapes. Ranks whose collectives must see equal shapes too (expert parallelism exchanges
tokens across data-parallel ranks) pass the largest `packed_shape` among them as `min_shape`:
rows grow to that length, and rows without any sample are appended.

Context parallelism splits every segment of a row (each sample, and the trailing padding)
into 2 * cp chunks (see `megatron_rl.trainer.context_parallel`): `segment_multiple` = 2 * cp
pads each sample's slot up to a multiple of it, with padding tokens of the sample's own
segment placed after its last token (the causal mask keeps them out of the real tokens'
attention, and they predict nothing).

Alignment: a sample of L tokens predicts L - 1 targets; per-token values that come with
a sample (loss mask, advantages, old log-probs) have length L - 1, and position j holds
the value for predicting token j + 1.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

Tensor = torch.Tensor


@dataclasses.dataclass
class Sample:
    """One sequence to train on.

    tokens: [L] prompt + response token ids.
    loss_mask: [L-1] 1.0 where predicting token j+1 counts in the loss (response tokens).
    extras: per-target tensors [L-1] (e.g. advantages, old_logprobs) or per-sample scalars.
    """

    tokens: Tensor
    loss_mask: Tensor
    extras: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.numel() < 2:
            raise ValueError(f"a sample needs at least 2 tokens, got shape {tuple(self.tokens.shape)}")
        if self.loss_mask.shape != (self.tokens.numel() - 1,):
            raise ValueError(f"loss_mask must have shape [{self.tokens.numel() - 1}] (one per target), "
                             f"got {tuple(self.loss_mask.shape)}")

    @property
    def num_targets(self) -> int:
        return self.tokens.numel() - 1


@dataclasses.dataclass
class MicroBatch:
    """One packed row. `valid` indexes the row positions that predict a real target, in
    sample order; `sample_ids[k]` is the index (into the caller's list) of the sample that
    target k belongs to."""

    input_ids: Tensor  # [1, S]
    position_ids: Tensor  # [1, S]
    targets: Tensor  # [1, S]
    attention_mask: Optional[Tensor]  # [1, 1, S, S] bool, True = masked out; None: THD attention
    padding: Tensor  # [1, S] bool, True = a position no sample's token occupies
    cu_seqlens: Tensor  # [n+1] int32 (THD attention)
    valid: Tensor  # [T] long
    sample_ids: Tensor  # [T] long
    sample_indices: list[int]
    loss_mask: Tensor  # [T]
    extras: dict[str, Tensor]  # each [T]
    # Set on a context-parallel rank's shard of a row (`context_parallel.shard`): the
    # tensors above then describe this rank's positions and targets only.
    context: Optional["ContextShard"] = None
    # Set by `to`, from the host's loss mask (no device sync): indices of the targets whose loss mask is set
    loss_rows: Optional[Tensor] = None

    @property
    def seq_len(self) -> int:
        """Positions in this micro-batch (a context-parallel shard: this rank's positions)."""
        return self.input_ids.shape[1]

    @property
    def row_len(self) -> int:
        """Length of the whole packed row (= `seq_len` without context parallelism)."""
        return int(self.cu_seqlens[-1])

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.loss_rows is None:
            moved["loss_rows"] = (self.loss_mask != 0).nonzero().squeeze(1)
        for key, value in moved.items():
            if isinstance(value, Tensor):
                moved[key] = value.to(device)
        moved["extras"] = {k: v.to(device) for k, v in self.extras.items()}
        if self.context is not None:
            moved["context"] = dataclasses.replace(self.context, target_index=self.context.target_index.to(device),
                                                   sample_ids=self.context.sample_ids.to(device))
        return MicroBatch(**moved)


@dataclasses.dataclass
class ContextShard:
    """How a context-parallel rank's targets sit in the whole row's target list."""

    target_index: Tensor  # [T_local] long: position of each local target among the row's targets
    sample_ids: Tensor  # [T_row] long: sample index of every target of the row
    num_targets: int  # T_row


def assign_rows(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices per row, each row's total length <= token_budget, in as few rows as first-fit decreasing
    needs, balanced: the samples go longest first to the lightest of those rows (LPT), where that keeps
    every row within the budget (else the first-fit rows are kept). All rows of a call are padded to the
    longest, so unbalanced rows cost padding: 4100 tokens under a budget of 4096 gave one full row and one
    of 4 tokens padded to 4096 (the step computed twice the tokens it had); balanced, two of 2050."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > token_budget]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sample {i} has {n} tokens, more than micro_batch_tokens={token_budget}: "
                         f"raise micro_batch_tokens or shorten the sequences")
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(token_budget - lengths[i])
    balanced: list[list[int]] = [[] for _ in rows]
    load = [0] * len(rows)
    for i in order:
        r = min(range(len(rows)), key=lambda k: (load[k], k))
        balanced[r].append(i)
        load[r] += lengths[i]
    if max(load, default=0) < token_budget - min(room, default=0):  # a shorter longest row
        rows = balanced
    return [sorted(row) for row in rows]


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _row_length(lengths: Sequence[int], rows: list[list[int]], pad_multiple: int) -> int:
    return _round_up(max(sum(lengths[i] for i in row) for row in rows), pad_multiple)


def packed_shape(lengths: Sequence[int], token_budget: int, pad_multiple: int = 1,
                 segment_multiple: int = 1) -> tuple[int, int]:
    """(number of rows, row length) that `pack` gives samples of these lengths ((0, 0) for none)."""
    if not lengths:
        return 0, 0
    slots = [_round_up(n, segment_multiple) for n in lengths]
    rows = assign_rows(slots, token_budget)
    return len(rows), _row_length(slots, rows, pad_multiple)


def pack(samples: Sequence[Sample], token_budget: int, pad_multiple: int = 1,
         pad_token_id: int = 0, extras_keys: Optional[Sequence[str]] = None,
         min_shape: tuple[int, int] = (0, 0), segment_multiple: int = 1, dense_mask: bool = True) -> list[MicroBatch]:
    """Pack `samples` into micro-batches (see module docstring); at least `min_shape`
    = (rows, row length), a shape that `packed_shape` returned for some ranks' samples.
    `pad_multiple` must be a multiple of `segment_multiple` (so is the trailing padding).
    `dense_mask=False` leaves out the [S, S] mask (attention that reads `cu_seqlens` instead)."""
    if pad_multiple % segment_multiple:
        raise ValueError(f"pad_multiple={pad_multiple} must be a multiple of segment_multiple={segment_multiple}")
    if not samples:  # rows of padding only where a shape is asked for (a rank without samples)
        if min_shape[0] == 0:
            return []
        if extras_keys is None:
            raise ValueError("pack of no samples into rows of padding needs extras_keys")
        return [_pack_row(samples, [], min_shape[1], pad_token_id, list(extras_keys), segment_multiple, dense_mask)
                for _ in range(min_shape[0])]
    slots = [_round_up(s.tokens.numel(), segment_multiple) for s in samples]
    rows = assign_rows(slots, token_budget)
    seq_len = max(_row_length(slots, rows, pad_multiple), min_shape[1])
    rows += [[] for _ in range(min_shape[0] - len(rows))]
    keys = list(extras_keys if extras_keys is not None else samples[0].extras.keys())
    return [_pack_row(samples, row, seq_len, pad_token_id, keys, segment_multiple, dense_mask) for row in rows]


def _pack_row(samples: Sequence[Sample], row: list[int], seq_len: int, pad_token_id: int,
              keys: list[str], segment_multiple: int = 1, dense_mask: bool = True) -> MicroBatch:
    input_ids = torch.full((seq_len,), pad_token_id, dtype=torch.long)
    targets = torch.full((seq_len,), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(seq_len, dtype=torch.long)
    segment = torch.full((seq_len,), -1, dtype=torch.long)
    padding = torch.ones(seq_len, dtype=torch.bool)
    valid, sample_ids, masks, cu = [], [], [], [0]
    extras: dict[str, list[Tensor]] = {k: [] for k in keys}
    offset = 0
    for seg, i in enumerate(row):
        s = samples[i]
        n = s.tokens.numel()
        slot = _round_up(n, segment_multiple)
        input_ids[offset:offset + n] = s.tokens
        padding[offset:offset + n] = False
        targets[offset:offset + n - 1] = s.tokens[1:]
        position_ids[offset:offset + slot] = torch.arange(slot)
        segment[offset:offset + slot] = seg
        valid.append(torch.arange(offset, offset + n - 1))
        sample_ids.append(torch.full((n - 1,), i, dtype=torch.long))
        masks.append(s.loss_mask.float())
        for k in keys:
            value = s.extras[k]
            extras[k].append(value.expand(n - 1) if value.dim() == 0 else value)
        offset += slot
        cu.append(offset)
    if offset < seq_len:
        # Padding forms its own segment so that every row of the mask attends somewhere.
        segment[offset:] = len(row)
        position_ids[offset:] = torch.arange(seq_len - offset)
        cu.append(seq_len)
    mask = None
    if dense_mask:
        same = segment.unsqueeze(0) == segment.unsqueeze(1)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        mask = ~(same & causal).view(1, 1, seq_len, seq_len)
    return MicroBatch(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        targets=targets.unsqueeze(0),
        attention_mask=mask,
        padding=padding.unsqueeze(0),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        valid=_cat(valid, torch.long),
        sample_ids=_cat(sample_ids, torch.long),
        sample_indices=list(row),
        loss_mask=_cat(masks, torch.float),
        extras={k: _cat(v, torch.float) for k, v in extras.items()},
    )


def _cat(parts: list[Tensor], empty_dtype: torch.dtype) -> Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=empty_dtype)  # a row without samples


def split_for_data_parallel(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Sample indices per DP rank, balancing total tokens (longest first to the lightest rank).

    Deterministic; every rank computes the same split from the same global batch. With fewer
    samples than ranks (a filtered batch) some shares are empty: those ranks train on a row of
    padding (`Trainer._micro_batches`).
    """
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        r = min(range(dp_size), key=lambda k: (load[k], len(shares[k]), k))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]
