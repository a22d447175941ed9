"""The parallel layout (`parallel.*`) and the optimizer (`optimizer.*`).

Each dataclass checks its own fields in ``__post_init__`` (see megatron_rl/config/schema.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from megatron_rl.checks import check_choice as _check_choice
from megatron_rl.checks import check_min as _check_min
from megatron_rl.checks import format_value
from megatron_rl.checks import invalid as _invalid
from megatron_rl.config.common import _check_unit_interval

if TYPE_CHECKING:
    from megatron_rl.config.model import ModelConfig


@dataclass
class ParallelConfig:
    """Megatron model-parallel layout; the data-parallel size is derived from the world size."""

    tp: int = 1
    """Tensor-parallel size (Megatron's tensor_model_parallel_size)."""
    pp: int = 1
    """Pipeline-parallel size (Megatron's pipeline_model_parallel_size)."""
    cp: int = 1
    """Context-parallel size (Megatron's context_parallel_size): every packed row is split over cp
    ranks for sequences too long for one (samples padded to multiples of 2 * cp); not with
    algorithm.policy_loss=gspo, whose ratio needs a whole sequence on one rank."""
    ep: int = 1
    """Expert-parallel size (Megatron's expert_model_parallel_size): experts are split over ep ranks
    taken from the data-parallel ranks; must divide model.num_experts, and etp * ep * pp the world size (etp:
    the expert tensor-parallel size below)."""
    etp: Optional[int] = None
    """Expert tensor-parallel size (Megatron's expert_tensor_parallel_size): experts split over etp ranks
    of each tensor-parallel group; null means tp, except for model.family=gpt_oss, whose biased experts
    Megatron-core runs only with etp=1."""
    sequence_parallel: bool = False
    """Shard activations along the sequence inside tensor-parallel regions; needs tp > 1."""
    use_distributed_optimizer: Optional[bool] = None
    """Shard the optimizer state (Adam moments, fp32 master weights) over the data-parallel ranks (ZeRO-1):
    gradients are reduce-scattered, each rank updates its shard, the parameters are all-gathered. null: on when
    the trainer runs on GPUs (cluster.device=cuda, or auto on a machine with an NVIDIA GPU), off on CPU; resolved
    when the config is typed (the run's config.yaml holds the choice). A training checkpoint records it: a run
    resumes from it only with the same setting."""
    overlap_grad_reduce: Optional[bool] = None
    """Overlap the data-parallel gradient reduction (all-reduce, or reduce-scatter with the distributed
    optimizer) with the backward pass, bucket by bucket; with one data-parallel rank there is nothing to overlap
    (harmless). null: on when the trainer runs on GPUs, off on CPU (resolved as above)."""
    overlap_param_gather: Optional[bool] = None
    """Distributed optimizer: all-gather the updated parameters during the next forward (each bucket just before
    its first layer runs) instead of at the end of the optimizer step; weight syncs, HF exports and checkpoints
    gather first. Needs use_distributed_optimizer=true. null: on when the trainer runs on GPUs with the
    distributed optimizer, else off (resolved as above)."""

    def __post_init__(self) -> None:
        _check_min("parallel.tp", self.tp, 1)
        _check_min("parallel.pp", self.pp, 1)
        _check_min("parallel.cp", self.cp, 1)
        _check_min("parallel.ep", self.ep, 1)
        if self.etp is not None and self.etp not in (1, self.tp):
            raise _invalid("parallel.etp", self.etp, f"must be 1 or parallel.tp={self.tp} (or null: tp)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "parallel.sequence_parallel=true is invalid with parallel.tp=1: sequence parallelism "
                "shards tensor-parallel regions; set parallel.tp>1 or parallel.sequence_parallel=false"
            )
        if self.overlap_param_gather and self.use_distributed_optimizer is False:
            raise self._overlap_param_gather_error("parallel.use_distributed_optimizer=false")

    def resolve_device_defaults(self, gpus: bool) -> None:
        """Replace the null (device-dependent) settings: on when the trainer runs on GPUs, off otherwise;
        overlap_param_gather only with the distributed optimizer."""
        distopt_default = self.use_distributed_optimizer is None
        if distopt_default:
            self.use_distributed_optimizer = gpus
        if self.overlap_grad_reduce is None:
            self.overlap_grad_reduce = gpus
        if self.overlap_param_gather is None:
            self.overlap_param_gather = gpus and self.use_distributed_optimizer
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise self._overlap_param_gather_error("parallel.use_distributed_optimizer=null, which is off on CPU"
                                                   if distopt_default else "parallel.use_distributed_optimizer=false")

    @staticmethod
    def _overlap_param_gather_error(distopt: str) -> Exception:
        return _invalid("parallel.overlap_param_gather", True, f"only the distributed optimizer gathers parameters, "
                        f"and {distopt}: set parallel.use_distributed_optimizer=true or "
                        "parallel.overlap_param_gather=false")

    def expert_tp(self, model: ModelConfig) -> int:
        """etp with its default applied: tp, or 1 for a model whose experts have biases."""
        if self.etp is not None:
            return self.etp
        return 1 if model.linear_bias else self.tp

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the model: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    def dp_size(self, world_size: int) -> int:
        """Data-parallel size ``world_size // (tp * pp * cp)``; ValueError if it does not divide."""
        if world_size < 1 or world_size % self.model_parallel_size != 0:
            raise ValueError(
                f"world_size={world_size} is not divisible by parallel.tp*parallel.pp*parallel.cp="
                f"{self.tp}*{self.pp}*{self.cp}={self.model_parallel_size}: "
                f"choose sizes whose product divides {world_size}"
            )
        return world_size // self.model_parallel_size


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "adam"
    """Optimizer: adam (AdamW-style decoupled weight decay) or sgd."""
    lr: float = 1e-6
    """Peak learning rate, reached after the warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay; at most lr."""
    weight_decay: float = 0.0
    """Decoupled weight-decay coefficient."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    lr_decay_style: str = "constant"
    """Decay after warmup: constant, linear or cosine."""
    lr_decay_steps: Optional[int] = None
    """Steps over which lr decays to min_lr; null means until num_steps."""

    NAMES: ClassVar[tuple[str, ...]] = ("adam", "sgd")
    DECAY_STYLES: ClassVar[tuple[str, ...]] = ("constant", "linear", "cosine")

    def __post_init__(self) -> None:
        _check_choice("optimizer.name", self.name, self.NAMES)
        _check_choice("optimizer.lr_decay_style", self.lr_decay_style, self.DECAY_STYLES)
        _check_min("optimizer.lr", self.lr, 0, strict=True)
        _check_min("optimizer.min_lr", self.min_lr, 0)
        if self.min_lr > self.lr:
            raise _invalid("optimizer.min_lr", self.min_lr, f"must be <= optimizer.lr={format_value(self.lr)}")
        _check_min("optimizer.weight_decay", self.weight_decay, 0)
        _check_unit_interval("optimizer.adam_beta1", self.adam_beta1, low_open=False, high_open=True)
        _check_unit_interval("optimizer.adam_beta2", self.adam_beta2, low_open=False, high_open=True)
        _check_min("optimizer.adam_eps", self.adam_eps, 0, strict=True)
        _check_min("optimizer.clip_grad", self.clip_grad, 0)
        _check_min("optimizer.lr_warmup_steps", self.lr_warmup_steps, 0)
        if self.lr_decay_steps is not None:
            _check_min("optimizer.lr_decay_steps", self.lr_decay_steps, 1)
