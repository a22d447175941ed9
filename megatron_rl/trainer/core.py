"""The Megatron trainer: model + DDP + optimizer + LR schedule, `forward_logprobs` and
`train_step(samples, loss_fn)` with a pluggable loss.

Both calls take the *global* batch (the same list on every rank): it is split over data
parallel ranks by token count, packed into micro-batches under `micro_batch_tokens`, and
run through Megatron's forward-backward schedule (1F1B when pp > 1).

Loss normalisation: a loss function returns its micro-batch's contribution to the global
loss, already divided by the global denominator it wants (`LossInputs.num_tokens`,
`num_samples`, ...). Megatron's schedule divides each micro-batch loss by the number of
micro-batches and DDP averages gradients over DP ranks, so the trainer multiplies by
both; the gradient is then that of the sum of contributions, whatever the layout.
Metrics follow the same rule: per-micro-batch contributions, summed over the whole batch.

Context parallelism (`groups.cp_size > 1`): every packed row is split over the context-
parallel ranks (`trainer.context_parallel`); each rank's loss covers its own targets, the
schedule multiplies the loss by cp and DDP averages over data- x context-parallel ranks, so
the gradient is again that of the global sum. Attention then runs in THD layout
(`PackedSeqParams`), as it does on every Transformer Engine run: TE's causal attention
ignores a dense mask, so packed rows need their `cu_seqlens` to keep samples apart.

Data parallelism is Megatron's DDP (`parallel.use_distributed_optimizer`, `overlap_grad_reduce`,
`overlap_param_gather`: on by default on GPUs). With `overlap_param_gather` an optimizer step updates only this
rank's shard of the parameters and the next forward all-gathers the rest, bucket by bucket; anything that reads
the weights without a forward (weight sync, export, checkpoint, snapshot) gets them through `gather_params`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.models.gpt import build_model, uses_packed_attention, uses_te
from megatron_rl.parallel.state import ParallelGroups
from megatron_rl.trainer import context_parallel, routing_replay
from megatron_rl.trainer.logprobs import (
    fused_vocab_parallel_stats,
    hidden_states_instead_of_logits,
    output_weight,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from megatron_rl.trainer.memory import move, optimizer_tensors
from megatron_rl.trainer.optimizer import build_optimizer
from megatron_rl.trainer.packing import MicroBatch, Sample, pack, packed_shape, split_for_data_parallel
from megatron_rl.weight_sync.sharding import gather_full_state_dict, load_full_state_dict

logger = logging.getLogger(__name__)
Tensor = torch.Tensor


@dataclasses.dataclass
class LossInputs:
    """What a loss function sees for one micro-batch (T = its number of targets)."""

    logprobs: Tensor  # [T] log p(target) under the current policy, with grad (a critic: the values V(s_t))
    entropy: Optional[Tensor]  # [T] or None when not requested
    loss_mask: Tensor  # [T] 1.0 for targets that count
    sample_ids: Tensor  # [T] index of each target's sample in the global batch
    sample_num_tokens: Tensor  # [T] loss tokens of that target's sample
    extras: dict[str, Tensor]  # [T] per-target values supplied with the samples
    num_tokens: int  # loss tokens in the global batch
    num_samples: int  # samples in the global batch
    # [T, k] log p(token) under the current policy, with grad, of the tokens extras[SUPPORT_IDS] [T, k] names at
    # each target position (None when the samples carry no SUPPORT_IDS): e.g. a distillation teacher's top k
    support_logprobs: Optional[Tensor] = None


SUPPORT_IDS = "support_ids"  # a sample extra [L-1, k] of token ids: the loss sees their log-probs (support_logprobs)


def _scatter_rows(values: Tensor, rows: Optional[Tensor], num_targets: int,
                  id_columns: tuple[int, int] = (0, 0)) -> Tensor:
    """values [len(rows), width] computed at `rows` of a micro-batch's num_targets targets, as [num_targets, width]
    with NaN at the other targets (0 in the columns id_columns = [start, end), which hold token ids)."""
    if rows is None:
        return values
    out = values.new_full((num_targets, values.shape[1]), float("nan"))
    out[:, id_columns[0]:id_columns[1]] = 0.0
    out[rows] = values
    return out


def _positions(mb: MicroBatch, rows: Optional[Tensor]) -> Tensor:
    """The row positions of the micro-batch's valid targets, or of those `rows` among them (Trainer._loss_rows)."""
    return mb.valid if rows is None else mb.valid[rows]


def _not_computed(mb: MicroBatch, width: int) -> Tensor:
    """NaN [T, width] for a micro-batch without loss targets, on its device: under context parallelism it joins the
    other ranks' gather (context_parallel.gather_targets), which an NCCL group runs on the device only."""
    return torch.full((mb.valid.numel(), width), float("nan"), device=mb.valid.device)


LossFn = Callable[[LossInputs], tuple[Tensor, dict[str, Tensor]]]
Routing = Optional[Any]  # a routing_replay.RoutingRecord, routing_replay.ENGINE or None (routers choose)


def token_mean_nll(inp: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood averaged over all loss tokens of the global batch (SFT)."""
    loss = -(inp.logprobs * inp.loss_mask).sum() / max(inp.num_tokens, 1)
    return loss, {"loss": loss.detach()}


@dataclasses.dataclass
class TrainerOptions:
    micro_batch_tokens: int = 2048
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # needs use_distributed_optimizer; see `gather_params`
    ddp_bucket_size: Optional[int] = None  # parameters per bucket under overlap_grad_reduce (None: Megatron's)
    deterministic: bool = True
    total_steps: int = 100
    pad_token_id: int = 0
    logprob_temperature: float = 1.0  # the rollout temperature: log-probs of logits / temperature
    routing_replay: bool = False  # a policy's MoE routers can record and replay routing (trainer/routing_replay.py)


class Trainer:
    """Owns this rank's model stage, its DDP wrapper, the Megatron optimizer and LR schedule.

    head="value" makes it a critic: the same architecture, untied, with `models/value_head.py`'s
    head in place of the output layer; `forward_logprobs` then returns each target position's
    value V(s_t) (the state before the target token) and a loss function sees them as
    `LossInputs.logprobs`."""

    HEADS = ("lm", "value")

    def __init__(self, model_cfg: Any, optim_cfg: Any, groups: ParallelGroups, options: TrainerOptions,
                 head: str = "lm"):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        if head not in self.HEADS:
            raise ValueError(f"head={head!r} is invalid: allowed values are {', '.join(self.HEADS)}")
        self.groups = groups
        self.options = options
        self.head = head
        if head == "value":  # the value head replaces the output layer: nothing to tie it to; all weights train
            model_cfg = dataclasses.replace(model_cfg, tie_word_embeddings=False, lora_rank=0)
        self.model_cfg = model_cfg
        self.use_te = uses_te(groups, model_cfg)
        # THD rows (cu_seqlens, no dense mask): TE's attention, context parallelism, the CPU path's PackedAttention
        self.thd = self.use_te or groups.cp_size > 1 or uses_packed_attention(model_cfg, self.use_te, groups.cp_size)
        module = build_model(model_cfg, groups, deterministic=options.deterministic, use_te=self.use_te)
        if head == "value":
            from megatron_rl.models.value_head import attach_value_head

            attach_value_head(module, groups)
        if model_cfg.lora_rank:  # adapters train, the rest stays as loaded (models/lora.py)
            from megatron_rl.models.lora import attach_lora, trainable

            adapters = attach_lora(module, model_cfg, groups)
            trainable(module)
            if groups.rank == 0:
                total = sum(p.numel() for p in module.parameters())
                train = sum(p.numel() for p in module.parameters() if p.requires_grad)
                logger.info("LoRA rank %d on %s: %d adapters, %d of this stage's %d parameters train (%.2f%%)",
                            model_cfg.lora_rank, ", ".join(model_cfg.lora_targets), len(adapters), train, total,
                            100.0 * train / max(total, 1))
        self.routing_layers = routing_replay.attach(module) if options.routing_replay and head == "lm" else []
        self.last_routing: Optional[routing_replay.RoutingRecord] = None  # forward_logprobs(record_routing=True)
        self.last_logprobs: Optional[list[Tensor]] = None  # train_step(keep_logprobs=True)
        if options.overlap_param_gather and not options.use_distributed_optimizer:
            raise ValueError("TrainerOptions(overlap_param_gather=True) needs use_distributed_optimizer=True: only "
                             "the distributed optimizer all-gathers parameters")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=options.overlap_grad_reduce,
            overlap_param_gather=options.overlap_param_gather,
            use_distributed_optimizer=options.use_distributed_optimizer,
            bucket_size=options.ddp_bucket_size,
        )
        self.model = DistributedDataParallel(module.config, ddp_config, module)
        config = module.config
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.model.no_sync
        if options.overlap_grad_reduce:
            config.grad_sync_func = self.model.start_grad_sync
        self.optimizer, self.scheduler = build_optimizer(self.model, optim_cfg, options)
        self._params_behind = False  # overlap_param_gather: other ranks' parameter shards not gathered yet
        self.step = 0  # optimizer steps taken by this model (warm start included)
        self.optimizer_step = 0  # steps taken by the current optimizer (Adam's bias correction)
        # times weights were loaded (a state dict, an HF checkpoint, a training checkpoint): a LoRA model's base
        # may have changed, which an engine holding it must receive again (rollout.weight_sync=adapters)
        self.weights_loaded = 0

    def reset_optimizer(self, optim_cfg: Any, total_steps: int) -> None:
        """A fresh optimizer and LR schedule for the same weights (e.g. RL after a warm start)."""
        self.options = dataclasses.replace(self.options, total_steps=total_steps)
        self.optimizer, self.scheduler = build_optimizer(self.model, optim_cfg, self.options)
        self.optimizer_step = 0

    # -- weights ------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    def gather_params(self) -> None:
        """Make every parameter hold the weights of the last optimizer step. With `overlap_param_gather` the
        distributed optimizer updates only this data-parallel rank's shard of the parameter buffer and leaves the
        all-gather of the other ranks' shards to the next forward: Megatron's forward pre-hooks wait for each
        bucket before its first module runs (megatron/core/distributed/distributed_data_parallel.py:384-418,
        optimizer/distrib_optimizer.py:2612-2619). Whatever reads the weights without a forward (weight sync,
        HF export, checkpoints, snapshots) calls this first. A collective over the data-parallel ranks when a
        gather is due (every rank calls it: each steps alike), else nothing."""
        if self._params_behind:
            self.model.start_param_sync(force_sync=True)  # synchronous; the hooks then find nothing to wait for
            self._params_behind = False

    def load_full_state_dict(self, full: dict[str, Tensor]) -> None:
        """Set weights from a full Megatron-named state dict (each rank takes its shard)."""
        load_full_state_dict(self.module, full, self.groups)
        self.optimizer.reload_model_params()
        self.weights_loaded += 1

    def _weight_tensors(self) -> list[Tensor]:
        """This rank's parameter shards, then its weight buffers (the routers' selection bias, which
        `model.moe_router_bias_update_rate` moves), in a fixed order. With LoRA only the adapters among the
        parameters: the others are frozen, the same in every snapshot (a reference policy costs the adapters)."""
        from megatron_rl.weight_sync.sharding import WEIGHT_BUFFERS

        buffers = [b for name, b in self.module.named_buffers() if name.endswith(WEIGHT_BUFFERS)]
        params = [p for p in self.module.parameters() if p.requires_grad or not self.model_cfg.lora_rank]
        return [*params, *buffers]

    def snapshot_weights(self) -> list[Tensor]:
        """This rank's weights (`_weight_tensors`), copied to host memory (e.g. the reference policy)."""
        self.gather_params()
        pin = self.groups.device.type != "cpu"
        return [p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().clone()
                for p in self._weight_tensors()]

    @torch.no_grad()
    def swap_weights(self, snapshot: list[Tensor]) -> list[Tensor]:
        """Load `snapshot` into the model and return the weights it replaced (swap back later). A snapshot
        from before the weight buffers were part of it (a resumed reference policy) leaves them as they are."""
        current = self.snapshot_weights()
        for p, saved in zip(self._weight_tensors(), snapshot):
            p.copy_(saved, non_blocking=True)
        return current

    @torch.no_grad()
    def copy_body_from(self, policy: "Trainer") -> None:
        """A critic's start: every weight of `policy` (a trainer at the same layout) except its output
        layer, and a zero value head (values 0 everywhere)."""
        from megatron_rl.models.lora import merged_weight
        from megatron_rl.models.value_head import is_head_parameter

        policy.gather_params()
        # the policy's weights as the engine sees them: a LoRA policy's merged (models/lora.py), one at a time
        source = {}
        for module_name, module in policy.module.named_modules():
            prefix = module_name + "." if module_name else ""
            for name, param in module.named_parameters(recurse=False):
                source.setdefault(prefix + name, (module, name, param))
        source.update((name, (None, name, buffer)) for name, buffer in policy.module.named_buffers())
        own = dict(self.module.named_parameters())
        for name, tensor in [*own.items(), *self.module.named_buffers()]:
            if is_head_parameter(name):
                tensor.zero_()
            elif name in source and source[name][2].shape == tensor.shape:
                module, local, value = source[name]
                tensor.copy_(value if module is None else merged_weight(module, local, value))
            elif name in own:
                raise ValueError(f"the policy has no weight {name!r} of shape {tuple(tensor.shape)} for the critic")
        self.optimizer.reload_model_params()

    def load_hf(self, path: str) -> None:
        """Set weights from an HF checkpoint directory (each rank reads only what it needs)."""
        from megatron_rl.checkpoint.hf import load_hf_into_model

        load_hf_into_model(self.module, path, self.model_cfg, self.groups)
        self.optimizer.reload_model_params()
        self.weights_loaded += 1

    def initialize_weights(self) -> None:
        """Weights from `model.path` when set, else a seeded `transformers` random initialisation."""
        from megatron_rl.models.hf import random_state_dict

        if self.model_cfg.path:
            self.load_hf(self.model_cfg.path)
        else:
            self.load_full_state_dict(random_state_dict(self.model_cfg, self.model_cfg.init_seed))

    # -- memory time-sharing with rollout engines ----------------------------------------------
    def _params_to(self, device: Any, adapters_only: bool = False) -> int:
        """Move the parameters DDP's buffers do not hold to `device` (pinned host memory for "cpu");
        returns the bytes moved. Megatron's DDP keeps parameters in a buffer of its own (which
        `offload_to_cpu` moves) only with the distributed optimizer: otherwise `param_data` is None
        and each parameter is moved by itself, keeping its identity (the optimizer's references). Frozen
        parameters (a LoRA model's base weights) are in no buffer: moved by themselves too, unless
        `adapters_only` (then only LoRA adapters move)."""
        moved = 0
        for param in self._params_moved_alone(adapters_only):
            if param.device.type != torch.device(device).type:
                moved += param.numel() * param.element_size()
                move(param, device)
        return moved

    def _params_moved_alone(self, adapters_only: bool = False) -> list[torch.nn.Parameter]:
        """The parameters `_params_to` moves: those in no DDP buffer (with `adapters_only`, LoRA adapters)."""
        from megatron_rl.models.lora import is_adapter_param

        in_buffer = {id(param) for buffer in self.model.buffers + self.model.expert_parallel_buffers
                     if buffer.param_data is not None for param in buffer.params}
        return [param for name, param in self.module.named_parameters()
                if id(param) not in in_buffer and (is_adapter_param(name) or not adapters_only)]

    def offload(self) -> int:
        """Move parameters, gradients and optimizer state off the accelerator (to pinned host
        memory); returns the bytes moved. On CPU there is nothing to move: returns 0."""
        if self.groups.device.type == "cpu":
            return 0
        moved = self._params_to("cpu")
        for buffer in self.model.buffers + self.model.expert_parallel_buffers:
            if buffer.param_data is not None:
                moved += buffer.param_data.numel() * buffer.param_data.element_size()
            if buffer.grad_data is not None:
                moved += buffer.grad_data.numel() * buffer.grad_data.element_size()
            buffer.offload_to_cpu(move_params=True, move_grads=True)
        for tensor in optimizer_tensors(self.optimizer):
            moved += tensor.numel() * tensor.element_size()
            move(tensor, "cpu")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return moved

    def onload(self) -> int:
        """Undo `offload`; returns the bytes moved back."""
        if self.groups.device.type == "cpu":
            return 0
        moved = self._params_to(self.groups.device)
        for buffer in self.model.buffers + self.model.expert_parallel_buffers:
            buffer.reload_from_cpu(move_params=True, move_grads=True)
            if buffer.param_data is not None:
                moved += buffer.param_data.numel() * buffer.param_data.element_size()
        for tensor in optimizer_tensors(self.optimizer):
            move(tensor, self.groups.device)
            moved += tensor.numel() * tensor.element_size()
        torch.cuda.synchronize()
        return moved

    def onload_weights_for_sync(self, adapters_only: bool = False) -> None:
        """Bring back only the parameters (weight sync reads them), all-gathered (`gather_params`); grads and
        optimizer stay off. With `adapters_only` (an adapter-only sync) a LoRA model's frozen base stays off too
        (DDP's buffers hold only trainable parameters: with LoRA, the adapters)."""
        if self.groups.device.type != "cpu":
            self._params_to(self.groups.device, adapters_only)
            for buffer in self.model.buffers + self.model.expert_parallel_buffers:
                buffer.reload_from_cpu(move_params=True, move_grads=False)
        self.gather_params()

    def offload_weights_after_sync(self, adapters_only: bool = False) -> None:
        if self.groups.device.type != "cpu":
            self._params_to("cpu", adapters_only)
            for buffer in self.model.buffers + self.model.expert_parallel_buffers:
                buffer.offload_to_cpu(move_params=True, move_grads=False)
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()  # sync buckets the engine has opened over CUDA IPC: free them now
            torch.cuda.empty_cache()

    def memory_plan(self) -> dict[str, int]:
        """Bytes held by this rank's parameters, gradient buffers and optimizer state."""
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        grads = sum(b.grad_data.numel() * b.grad_data.element_size()
                    for b in self.model.buffers + self.model.expert_parallel_buffers if b.grad_data is not None)
        optim = sum(t.numel() * t.element_size() for t in optimizer_tensors(self.optimizer))
        return {"params": params, "grads": grads, "optimizer": optim}

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's weights, gathered over the model-parallel ranks (a collective: every rank calls it)."""
        self.gather_params()
        return gather_full_state_dict(self.module, self.groups)

    # -- forward ------------------------------------------------------------------------------
    def _micro_batches(self, samples: Sequence[Sample]) -> tuple[list[list[int]], list[MicroBatch]]:
        """(every DP rank's sample indices, this rank's packed micro-batches)."""
        lengths = [s.tokens.numel() for s in samples]
        shares = split_for_data_parallel(lengths, self.groups.dp_size)
        mine = shares[self.groups.dp_rank]
        cp = self.groups.cp_size
        # Each rank's share of a row must split evenly over TP ranks under sequence parallelism.
        segment_multiple = 2 * cp if cp > 1 else 1
        pad_multiple = math.lcm(segment_multiple, cp * (self.groups.tp_size if self.groups.sequence_parallel else 1))
        min_shape = (0, 0)
        if self.groups.ep_size > 1:
            # Experts exchange tokens across data-parallel ranks once per micro-batch and MoE
            # layer, with equal-size collectives: every rank runs the largest rank's shape.
            shapes = [packed_shape([lengths[i] for i in share], self.options.micro_batch_tokens, pad_multiple,
                                   segment_multiple) for share in shares]
            min_shape = (max(r for r, _ in shapes), max(n for _, n in shapes))
        if not mine:  # fewer samples than DP ranks: a row of padding still takes part in the gradient reduction
            min_shape = (max(min_shape[0], 1), max(min_shape[1], pad_multiple))
        thd = self.thd  # attention reads cu_seqlens: no [S, S] mask to build and move
        micro = pack([samples[i] for i in mine], self.options.micro_batch_tokens, pad_multiple,
                     self.options.pad_token_id, extras_keys=list(samples[0].extras), min_shape=min_shape,
                     segment_multiple=segment_multiple, dense_mask=not thd)
        for mb in micro:  # map row-local sample indices back to global-batch indices
            mb.sample_ids = torch.tensor(mine, dtype=torch.long)[mb.sample_ids]
            mb.sample_indices = [mine[i] for i in mb.sample_indices]
        if cp > 1:
            micro = [context_parallel.shard(mb, cp, self.groups.cp_rank) for mb in micro]
        return shares, [mb.to(self.groups.device) for mb in micro]

    def _packed_seq_params(self, mb: MicroBatch):
        """THD attention parameters of the row (None: dense-mask attention, CPU without CP)."""
        if not self.thd:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = mb.cu_seqlens.to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        # Segments are already padded (to 2 * cp under context parallelism): padded = actual bounds.
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)

    def _padding_mask(self, mb: MicroBatch) -> Optional[Tensor]:
        """The row's padding for a mixture of experts' routers (None for a dense model): their expert loads
        (auxiliary-loss-free bias update) and load-balancing loss then count only real tokens. GPTModel splits
        it over the TP ranks' sequence shards only on the first pipeline stage (gpt_model.py:314-321); the
        other stages get their shard here."""
        if not self.model_cfg.is_moe:
            return None
        if not (self.groups.sequence_parallel and not self.groups.is_first_stage):
            return mb.padding
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        return scatter_to_sequence_parallel_region(mb.padding.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()

    def _run(self, micro: list[MicroBatch], loss_func_for: Callable[[MicroBatch], Callable],
             forward_only: bool, replay: Optional[routing_replay.Replay] = None) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            index, mb = next(data_iterator)
            if replay is not None:
                replay.select(index, mb, self._router_tokens_real(mb))
            output = model(mb.input_ids, mb.position_ids, mb.attention_mask,
                           packed_seq_params=self._packed_seq_params(mb), padding_mask=self._padding_mask(mb))
            return output, loss_func_for(mb)

        # Fused log-probs: the last stage's model returns hidden states, `_target_stats` does the rest.
        output_hidden = contextlib.nullcontext()
        if self.model_cfg.fused_logprobs and self.groups.is_last_stage and self.head == "lm":
            tp_group = self.groups.tp_group if self.groups.tp_size > 1 else None
            output_hidden = hidden_states_instead_of_logits(self.module, tp_group, self.groups.sequence_parallel)
        with output_hidden:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(enumerate(micro)),
                model=[self.model],
                num_microbatches=len(micro),
                seq_length=micro[0].row_len,  # the schedule divides by cp (and tp under SP)
                micro_batch_size=1,
                forward_only=forward_only,
            )

    def _target_stats(self, mb: MicroBatch, output: Tensor, with_entropy: bool, rows: Optional[Tensor] = None):
        """(log-probs, entropies) of the row's valid targets from the model output: final hidden
        states [1, S, h] on the fused path, else vocab-parallel logits [1, S, V/tp]. A critic's: (values
        from its [1, S, 1] output, None). rows: only those targets (indices into the valid ones, `_loss_rows`)."""
        positions = _positions(mb, rows)
        if self.head == "value":
            return output[0, :, 0][positions], None
        if self.model_cfg.fused_logprobs:
            tp_group = self.groups.tp_group if self.groups.tp_size > 1 else None
            return fused_vocab_parallel_stats(output[0][positions], output_weight(self.module),
                                              mb.targets[0][positions], tp_group, self.groups.tp_rank,
                                              self.options.logprob_temperature, with_entropy)
        logits = output[0]  # [S, V/tp]
        if self.options.logprob_temperature != 1.0:
            logits = logits / self.options.logprob_temperature
        entropy = None
        if with_entropy:  # first: Megatron's cross entropy overwrites the logits in place
            tp_group = self.groups.tp_group if self.groups.tp_size > 1 else None
            entropy = vocab_parallel_entropy(logits[positions], tp_group)
        logprobs = vocab_parallel_logprobs(logits, mb.targets[0])[positions]
        return logprobs, entropy

    @staticmethod
    def _loss_rows(mb: MicroBatch) -> Optional[Tensor]:
        """Indices of the micro-batch's valid targets whose loss mask is set, or None when all are. The update's
        losses see only these (every loss term is masked): the output layer's work on a prompt's positions, or a
        tool's output, would be spent on numbers multiplied by 0."""
        rows = mb.loss_rows if mb.loss_rows is not None else (mb.loss_mask != 0).nonzero().squeeze(1)
        return None if rows.numel() == mb.valid.numel() else rows

    def _fused_inputs(self, mb: MicroBatch, output: Tensor, rows: Optional[Tensor] = None
                      ) -> tuple[Tensor, Tensor, Any, int]:
        """(hidden [T, h] of the row's valid targets (rows: only those), this rank's output weight shard [V/tp, h],
        the TP group or None, the shard's first vocabulary row) on the fused path, whose last stage returns hidden
        states."""
        if not self.model_cfg.fused_logprobs or self.head != "lm":
            raise ValueError("several tokens' log-probs per position (top-k distillation) need an lm trainer with "
                             "model.fused_logprobs=true: the model must return its final hidden states")
        weight = output_weight(self.module)
        tp_group = self.groups.tp_group if self.groups.tp_size > 1 else None
        return output[0][_positions(mb, rows)], weight, tp_group, self.groups.tp_rank * weight.shape[0]

    def _support_logprobs(self, mb: MicroBatch, output: Tensor, rows: Optional[Tensor] = None) -> Tensor:
        """[T, k] log-probs, with grad, of the tokens mb.extras[SUPPORT_IDS] names at each valid target (rows: only
        those)."""
        from megatron_rl_kernels import logprobs_at

        hidden, weight, tp_group, vocab_start = self._fused_inputs(mb, output, rows)
        ids = mb.extras[SUPPORT_IDS] if rows is None else mb.extras[SUPPORT_IDS][rows]
        return logprobs_at(hidden, weight, ids, tp_group=tp_group, vocab_start=vocab_start,
                           temperature=self.options.logprob_temperature)

    @torch.no_grad()
    def forward_topk(self, samples: Sequence[Sample], k: int, vocab_limit: Optional[int] = None
                     ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per sample, on every rank: (log p(target) [L-1], the k likeliest tokens' ids [L-1, k] and their log-probs
        [L-1, k], most likely first) at each target position, at the options' logprob_temperature, over the whole
        vocabulary (megatron_rl_kernels.topk_logprobs); vocab_limit: only ids below it are candidates. Needs the
        fused path (model.fused_logprobs). Only the positions of each sample's loss mask are computed (a prompt's
        are not: the top k over the whole vocabulary costs an output layer's pass per position); the others hold
        NaN log-probs and token id 0, so that a reader who forgot the mask gets NaN, not a plausible number."""
        from megatron_rl_kernels import topk_logprobs

        if self.model_cfg.vocab_size >= 1 << 24:
            raise ValueError(f"forward_topk carries token ids as float32, exact below 2**24; vocab_size="
                             f"{self.model_cfg.vocab_size} is not")
        shares, micro = self._micro_batches(samples)
        local: dict[int, Tensor] = {}

        def loss_func_for(mb: MicroBatch):
            def loss_func(output: Tensor):
                if not mb.sample_indices:  # a padding row (expert parallelism)
                    return output.sum() * 0.0, {}
                rows = self._loss_rows(mb)
                hidden, weight, tp_group, vocab_start = self._fused_inputs(mb, output, rows)
                lp, ids, lps = topk_logprobs(hidden, weight, mb.targets[0][_positions(mb, rows)], k,
                                             tp_group=tp_group, vocab_start=vocab_start,
                                             temperature=self.options.logprob_temperature, vocab_limit=vocab_limit)
                found = torch.cat([lp[:, None], ids.float(), lps], dim=1)
                self._keep_per_sample(mb, _scatter_rows(found, rows, mb.valid.numel(), id_columns=(1, 1 + k)), local)
                return output.sum() * 0.0, {}
            return loss_func

        self.model.eval()
        self._run(micro, loss_func_for, forward_only=True)
        self.model.train()
        rows = self._per_sample_rows(samples, shares, local, 1 + 2 * k)
        # copies: views would keep each [L-1, 1 + 2k] float32 block alive (16 bytes x k per token, not 12)
        return [(r[:, 0].clone(), r[:, 1:1 + k].long(), r[:, 1 + k:].clone()) for r in rows]

    @torch.no_grad()
    def forward_logprobs(self, samples: Sequence[Sample], with_entropy: bool = False, record_routing: bool = False,
                         routing: Routing = None, loss_targets_only: bool = False
                         ) -> tuple[list[Tensor], Optional[list[Tensor]]]:
        """Log-probs (and entropies) of every sample's targets, on every rank: lists of [L-1]. A critic
        (head="value") returns its values V(s_t) at those positions instead. record_routing=True keeps
        the MoE routing of this forward in `last_routing`; `routing` replays one, or with
        routing_replay.ENGINE the routing the samples carry (the trainer needs options.routing_replay).
        loss_targets_only: an lm computes the targets of each sample's loss mask only (the output layer's work on a
        prompt's positions is skipped), and the others hold NaN."""
        shares, micro = self._micro_batches(samples)
        local: dict[int, Tensor] = {}
        width = 2 if with_entropy else 1

        def loss_func_for(mb: MicroBatch):
            def loss_func(logits: Tensor):
                if not mb.sample_indices:  # a padding row (expert parallelism)
                    return logits.sum() * 0.0, {}
                rows = self._loss_rows(mb) if loss_targets_only and self.head == "lm" else None
                if rows is not None and rows.numel() == 0:
                    self._keep_per_sample(mb, _not_computed(mb, width), local)
                    return logits.sum() * 0.0, {}
                lp, ent = self._target_stats(mb, logits, with_entropy, rows)
                found = lp[:, None] if ent is None else torch.stack([lp, ent], dim=1)
                self._keep_per_sample(mb, _scatter_rows(found, rows, mb.valid.numel()), local)
                return lp.sum() * 0.0, {}
            return loss_func

        self.model.eval()
        if record_routing:
            with routing_replay.Recording(self._routing_layers()) as recording:
                self._run(micro, loss_func_for, forward_only=True)
            self.last_routing = recording.record(micro)
        else:
            with self._replaying(routing, micro) as replay:
                self._run(micro, loss_func_for, forward_only=True, replay=replay)
        self.model.train()
        return self._per_sample(samples, shares, local, with_entropy)

    def _keep_per_sample(self, mb: MicroBatch, values: Tensor, local: dict[int, Tensor]) -> None:
        """Store a micro-batch's per-target values [T, width] (log-probs, entropies, ...), detached, per sample in
        `local` (host tensors [targets of the sample, width])."""
        values = values.detach()
        sample_ids = mb.sample_ids
        if mb.context is not None:  # this rank's targets -> the whole row's
            values = context_parallel.gather_targets(values, mb.context, self.groups.cp_group)
            sample_ids = mb.context.sample_ids
        # a row's targets come sample after sample (packing.pack): split them by runs of sample id
        ids, counts = torch.unique_consecutive(sample_ids.cpu(), return_counts=True)
        assert ids.numel() == len(set(ids.tolist())), "a packed sample's targets are not contiguous"
        split = {int(i): k for k, i in enumerate(ids)}
        runs = values.float().cpu().split(counts.tolist())
        empty = torch.zeros((0, *values.shape[1:]))
        for i in mb.sample_indices:  # a one-token sample has no target: no run of its own
            k = split.get(i)
            local[i] = empty if k is None else runs[k]

    def _per_sample_rows(self, samples: Sequence[Sample], shares: list[list[int]], local: dict[int, Tensor],
                         width: int) -> list[Tensor]:
        """Every sample's stored [L-1, width] values (`_keep_per_sample` on the last stage of each DP rank), on
        every rank."""
        sizes = [s.num_targets * width for s in samples]
        mine = shares[self.groups.dp_rank]
        flat = torch.zeros(sum(sizes[i] for i in mine))
        if self.groups.is_last_stage:
            parts = [local[i].reshape(-1) for i in mine]
            flat = torch.cat(parts) if parts else torch.zeros(0)
        per_rank = _share_across_ranks(flat, samples, shares, self.groups, width)
        rows: list[Optional[Tensor]] = [None] * len(samples)
        for share, values in zip(shares, per_rank):
            for i, chunk in zip(share, values.split([sizes[i] for i in share])):
                rows[i] = chunk.reshape(-1, width)
        return rows  # type: ignore[return-value]

    def _per_sample(self, samples: Sequence[Sample], shares: list[list[int]], local: dict[int, Tensor],
                    with_entropy: bool) -> tuple[list[Tensor], Optional[list[Tensor]]]:
        """Every sample's log-probs [L-1] (and entropies [L-1]: `local` holds [targets, 2] then), on every rank."""
        rows = self._per_sample_rows(samples, shares, local, 2 if with_entropy else 1)
        logprobs = [r[:, 0].contiguous() for r in rows]
        return logprobs, ([r[:, 1].contiguous() for r in rows] if with_entropy else None)

    # -- train --------------------------------------------------------------------------------
    def train_step(self, samples: Sequence[Sample], loss_fn: LossFn = token_mean_nll,
                   with_entropy: bool = False, routing: Routing = None, keep_logprobs: bool = False) -> dict[str, float]:
        """One optimizer step on the global batch `samples`; returns summed metrics plus
        `grad_norm` (before clipping), `lr` (the one this step used) and `num_tokens` (the
        same dict on every rank). With `routing` (a recording of a forward over the same samples, or
        routing_replay.ENGINE: the samples' own) the MoE layers route every token so, and
        `routing_drift` is the share of (token, layer) expert choices that the current routers would
        have made differently. The loss function sees the targets whose loss mask is set, only (LossInputs' T).
        keep_logprobs: `last_logprobs` holds every sample's log-probs of this step's forward afterwards (the weights
        before its update, detached; lists of [L-1] on every rank), as forward_logprobs would have given them before
        the step at the loss-mask targets, and NaN at the others (not computed)."""
        shares, micro = self._micro_batches(samples)
        kept: dict[int, Tensor] = {}
        num_tokens = int(sum(float(s.loss_mask.sum()) for s in samples))
        sample_tokens = torch.tensor([float(s.loss_mask.sum()) for s in samples])
        scale = len(micro) * self.groups.dp_size

        def loss_func_for(mb: MicroBatch):
            def loss_func(logits: Tensor):
                if not mb.sample_indices:  # a padding row (fewer samples than ranks, or EP): contributes nothing
                    return self._zero_loss(logits), {}
                # the loss terms are all masked: they see the loss-mask targets only (_loss_rows), and the others'
                # kept log-probs are NaN (the weights before the step give them: forward_logprobs)
                rows = self._loss_rows(mb)
                if rows is not None and rows.numel() == 0:  # prompts, tool output or filtered samples only
                    if keep_logprobs:
                        self._keep_per_sample(mb, _not_computed(mb, 1), kept)
                    return self._zero_loss(logits), {}
                lp, ent = self._target_stats(mb, logits, with_entropy, rows)
                if keep_logprobs:
                    self._keep_per_sample(mb, _scatter_rows(lp[:, None], rows, mb.valid.numel()), kept)
                # a critic trains on the same samples: the tokens' log-probs are the policy's affair
                wanted = SUPPORT_IDS in mb.extras and self.head == "lm"
                support = self._support_logprobs(mb, logits, rows) if wanted else None
                sample_ids = mb.sample_ids if rows is None else mb.sample_ids[rows]
                inputs = LossInputs(
                    logprobs=lp, entropy=ent, loss_mask=mb.loss_mask if rows is None else mb.loss_mask[rows],
                    sample_ids=sample_ids, sample_num_tokens=sample_tokens.to(lp.device)[sample_ids],
                    extras=mb.extras if rows is None else {name: v[rows] for name, v in mb.extras.items()},
                    num_tokens=num_tokens, num_samples=len(samples), support_logprobs=support)
                loss, metrics = loss_fn(inputs)
                return loss * scale, {k: v.detach().float().reshape(()) for k, v in metrics.items()}
            return loss_func

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        with self._replaying(routing, micro) as replay:
            stored = self._run(micro, loss_func_for, forward_only=False, replay=replay)
            drift = None if replay is None else self._drift(replay)
        ok, grad_norm, _ = self.optimizer.step()
        self._params_behind = self.options.overlap_param_gather  # the next forward, or `gather_params`, gathers
        if not ok:
            raise FloatingPointError(f"optimizer step {self.step} failed: non-finite gradients")
        self.scheduler.step(increment=1)
        self.step += 1
        self.optimizer_step += 1
        metrics = _reduce_metrics(stored, self.groups)
        self.last_logprobs = self._per_sample(samples, shares, kept, False)[0] if keep_logprobs else None
        metrics.update(grad_norm=float(grad_norm), lr=lr, num_tokens=float(num_tokens))
        if drift is not None:
            metrics["routing_drift"] = drift
        return metrics

    def _zero_loss(self, output: Tensor) -> Tensor:
        """A padding row's loss: 0, with a (zero) gradient for every trained weight, as a real row has. With
        parallel.overlap_grad_reduce a bucket's reduction starts once each of its parameters has a gradient
        (megatron/core/distributed/param_and_grad_buffer.py:552-561); on the fused path the output weight is
        not in the output's graph (the last stage returns hidden states), so it is added here."""
        loss = output.sum() * 0.0
        if self.model_cfg.fused_logprobs and self.head == "lm":
            loss = loss + output_weight(self.module).sum() * 0.0
        return loss

    # -- MoE routing replay ---------------------------------------------------------------------
    def _routing_layers(self) -> list[routing_replay.LayerRouting]:
        if not self.options.routing_replay or self.head != "lm":
            raise ValueError("routing replay needs a policy trainer built with TrainerOptions(routing_replay=True)")
        return self.routing_layers  # empty on a pipeline stage without MoE layers

    def _replaying(self, routing: Routing, micro: list[MicroBatch]):
        if routing is None:
            return contextlib.nullcontext()
        layers = self._routing_layers()
        if routing == routing_replay.ENGINE:
            sparse = self.model_cfg.sparse_layers
            columns = [sparse.index(layer.layer) for layer in layers]
            return routing_replay.Replay(layers, lambda index, mb: routing_replay.carried_routes(
                mb, columns, len(sparse), self.model_cfg.moe_router_topk, self._router_part))
        return routing_replay.Replay.of_record(layers, routing, micro)

    def _router_part(self, per_position: Tensor) -> Tensor:
        """The part of a row's per-position tensor (a context-parallel rank's shard of it) that a router on
        this rank sees: under sequence parallelism this TP rank's contiguous part."""
        if self.groups.sequence_parallel and self.groups.tp_size > 1:
            return per_position.chunk(self.groups.tp_size)[self.groups.tp_rank]
        return per_position

    def _router_tokens_real(self, mb: MicroBatch) -> Tensor:
        """[tokens a router on this rank sees] True where no padding."""
        return self._router_part(~mb.padding[0])

    def _drift(self, replay: routing_replay.Replay) -> float:
        """The replayed choices that differ from the routers' own, over every rank: TP ranks without
        sequence parallelism count the same tokens alike, which leaves the share unchanged."""
        counts = torch.tensor(replay.drift(), dtype=torch.float64, device=self.groups.device)
        dist.all_reduce(counts, group=self.groups.mp_group)
        dist.all_reduce(counts, group=self.groups.dp_cp_group)
        return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0


def _share_across_ranks(flat: Tensor, samples: Sequence[Sample], shares: list[list[int]],
                        groups: ParallelGroups, width: int) -> list[Tensor]:
    """Last stage's per-DP-rank results -> the results of every DP rank, on every rank (host tensors).
    The collectives run on the groups' device: NCCL groups take device tensors only."""
    if groups.pp_size > 1:
        flat = flat.to(groups.device)
        dist.broadcast(flat, src=groups.pp_last_rank, group=groups.pp_group)
    if groups.dp_size == 1:
        return [flat.cpu()]
    sizes = [sum(samples[i].num_targets for i in share) * width for share in shares]
    padded = torch.zeros(max(max(sizes), 1), device=groups.device)
    padded[: flat.numel()] = flat.to(groups.device)
    gathered = [torch.zeros_like(padded) for _ in range(groups.dp_size)]
    dist.all_gather(gathered, padded, group=groups.dp_group)
    return [g[:n].cpu() for g, n in zip(gathered, sizes)]


def _reduce_metrics(stored: list[dict], groups: ParallelGroups) -> dict[str, float]:
    keys = sorted({k for d in stored for k in d})  # padding rows report no metrics
    if groups.dp_size * groups.cp_size > 1 and groups.is_last_stage:
        # a rank holding only padding rows (fewer samples than ranks) knows no keys: agree on them first
        every: list = [None] * dist.get_world_size(groups.dp_cp_group)
        dist.all_gather_object(every, keys, group=groups.dp_cp_group)
        keys = sorted({k for ks in every for k in ks})
    # "max/<name>" metrics are maxima (e.g. the largest rollout/trainer log-prob gap), the others sums
    maxima = [k for k in keys if k.startswith("max/")]
    sums = [k for k in keys if not k.startswith("max/")]
    local = torch.tensor([sum(float(d[k]) for d in stored if k in d) for k in sums], dtype=torch.float64,
                         device=groups.device)  # NCCL groups take device tensors only
    peak = torch.tensor([max((float(d[k]) for d in stored if k in d), default=-math.inf) for k in maxima],
                        dtype=torch.float64, device=groups.device)
    if groups.dp_size * groups.cp_size > 1 and groups.is_last_stage:
        dist.all_reduce(local, group=groups.dp_cp_group)  # context-parallel ranks hold parts of each row
        if maxima:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=groups.dp_cp_group)
    payload = [{**dict(zip(sums, local.tolist())), **dict(zip(maxima, peak.tolist()))}]
    if groups.pp_size > 1:
        dist.broadcast_object_list(payload, src=groups.pp_last_rank, group=groups.pp_group)
    return payload[0]
