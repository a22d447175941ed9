"""CPU compatibility layer for megatron-core: the one place that patches it to run without CUDA.

megatron-core assumes CUDA in a handful of places (device literals, the CUDA RNG tracker,
a sequence-parallel assert on the torch norm) and, in the MoE router and multi-latent attention,
Transformer Engine (absent on CPU). On a CPU-only torch build those places fail;
everything else (tensor/sequence/pipeline/data parallelism over gloo) works unchanged.
Each patch below is narrow (one module's global or one function), cites the upstream
file:line it works around (megatron-core 0.16.1), and can be reverted, so that
`tests/distributed/test_cpu_compat.py` shows per patch that it is still needed and still works:
after a megatron-core upgrade that test names exactly what changed.

`activate()` is called by `megatron_rl.parallel.state.initialize` and does nothing when
CUDA is available. No library does this for us: Megatron has no CPU mode.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import logging
import types
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class UpstreamSite:
    """A line in megatron-core that a patch works around, with a snippet expected there."""

    path: str  # relative to the `megatron/core` package directory
    line: int
    snippet: str


@dataclasses.dataclass
class Patch:
    """One reversible patch. `apply`/`revert` must be idempotent."""

    name: str
    why: str
    sites: list[UpstreamSite]
    apply: Callable[[], None]
    revert: Callable[[], None]
    active: bool = False


_PATCHES: dict[str, Patch] = {}


def _register(name: str, why: str, sites: list[UpstreamSite]):
    def deco(factory: Callable[[], tuple[Callable[[], None], Callable[[], None]]]):
        apply, revert = factory()
        _PATCHES[name] = Patch(name, why, sites, apply, revert)
        return factory

    return deco


# --- 1. torch.cuda.current_device() used as the allocation device -------------------------------
@_register(
    "current_device",
    "allocations pass device=torch.cuda.current_device(); on a CPU build that raises",
    [
        UpstreamSite("tensor_parallel/layers.py", 552, "device=torch.cuda.current_device()"),
        UpstreamSite("models/common/embeddings/rotary_pos_embedding.py", 297, "device=torch.cuda.current_device()"),
        UpstreamSite("utils.py", 631, "device=torch.cuda.current_device()"),
    ],
)
def _current_device():
    original = torch.cuda.current_device

    def apply() -> None:
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    def revert() -> None:
        torch.cuda.current_device = original

    return apply, revert


# --- 2. the model-parallel RNG tracker reads and writes CUDA RNG state ---------------------------
@_register(
    "rng_tracker",
    "CudaRNGStatesTracker.add/fork call torch.cuda.get_rng_state / _set_cuda_rng_state",
    [
        UpstreamSite("tensor_parallel/random.py", 235, "torch.cuda.get_rng_state()"),
        UpstreamSite("tensor_parallel/random.py", 250, "_get_cuda_rng_state("),
    ],
)
def _rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    original = (mrandom.CudaRNGStatesTracker, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)

    class CpuRNGStatesTracker(original[0]):
        """Same bookkeeping as upstream, over the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

    def get_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def apply() -> None:
        mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
        mrandom._get_cuda_rng_state = get_state
        mrandom._set_cuda_rng_state = set_state
        # A tracker built before activation would still be the CUDA one.
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False

    def revert() -> None:
        mrandom.CudaRNGStatesTracker, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = original
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False

    return apply, revert


# --- 3. sequence parallel with the torch norm (no TE/Apex on CPU) --------------------------------
@_register(
    "torch_norm_sequence_parallel",
    "WrappedTorchNorm asserts `not config.sequence_parallel`; TE/Apex norms instead tag their "
    "params sequence_parallel=True so finalize_model_grads all-reduces them over TP",
    [UpstreamSite("transformer/torch_norm.py", 32, "assert not config.sequence_parallel")],
)
def _torch_norm_sp():
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                                normalization)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                            normalization)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    def apply() -> None:
        torch_norm.WrappedTorchNorm.__new__ = new

    def revert() -> None:
        torch_norm.WrappedTorchNorm.__new__ = original_new

    return apply, revert


# --- 4. literal device="cuda" in factory calls, per module -----------------------------------------
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like")


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda(types.ModuleType):
    """Stands in for `torch.cuda` inside one upstream module: synchronize is a no-op."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.synchronize = lambda *args, **kwargs: None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """Stands in for `torch` inside one upstream module: factories get device cuda -> cpu,
    `torch.cuda.synchronize()` does nothing."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for fname in _FACTORIES:
            real = getattr(torch, fname)

            def factory(*args, _real=real, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return _real(*args, **kwargs)

            setattr(self, fname, factory)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_DEVICE_LITERAL_MODULES = {
    "megatron.core.pipeline_parallel.schedules": UpstreamSite(
        "pipeline_parallel/schedules.py", 596, 'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")'
    ),
    "megatron.core.optimizer.optimizer": UpstreamSite(
        "optimizer/optimizer.py", 485, "self._scale_one = torch.tensor([1.0], dtype=torch.float, device='cuda')"
    ),
    "megatron.core.optimizer.clip_grads": UpstreamSite(
        "optimizer/clip_grads.py", 103, "dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device='cuda')"
    ),
    "megatron.core.pipeline_parallel.p2p_communication": UpstreamSite(
        "pipeline_parallel/p2p_communication.py", 398, "torch.cuda.synchronize()"
    ),
    "megatron.core.dist_checkpointing.strategies.filesystem_async": UpstreamSite(
        "dist_checkpointing/strategies/filesystem_async.py", 230, "torch.cuda.synchronize()"
    ),
    "megatron.core.utils": UpstreamSite(
        "utils.py", 1207, 'l2_cuda = torch.tensor([float(l2_reduced)], dtype=torch.float, device="cuda")'
    ),
}


@_register(
    "device_literals",
    'torch.zeros/tensor(..., device="cuda") in schedules, optimizer, clip_grads and the local '
    "multi-tensor l2 norm; torch.cuda.synchronize() after pipeline p2p and before checkpoint writes",
    list(_DEVICE_LITERAL_MODULES.values()),
)
def _device_literals():
    proxy = _CpuTorch()

    def apply() -> None:
        for mod_name in _DEVICE_LITERAL_MODULES:
            importlib.import_module(mod_name).torch = proxy

    def revert() -> None:
        for mod_name in _DEVICE_LITERAL_MODULES:
            importlib.import_module(mod_name).torch = torch

    return apply, revert


# --- 5. CUDA-only checks and moves inside a few construction-time functions -----------------------
class _CpuAsCuda(torch.overrides.TorchFunctionMode):
    """While active: `Tensor.cuda()` returns the tensor itself and `Tensor.type()` reports CPU
    types under their CUDA names. Entered only around the wrapped upstream functions below,
    which run at set-up or checkpoint time, never in a training step."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            if result.startswith("torch.") and not result.startswith("torch.cuda."):
                return "torch.cuda." + result[len("torch."):]
        return result


def _wrap_in_mode(attr: Any) -> Any:
    """Wrap a function, staticmethod or classmethod so that it runs under `_CpuAsCuda`."""
    if isinstance(attr, (staticmethod, classmethod)):
        return type(attr)(_wrap_in_mode(attr.__func__))

    def wrapped(*args, **kwargs):
        with _CpuAsCuda():
            return attr(*args, **kwargs)

    return wrapped


@_register(
    "cuda_at_setup_and_checkpoint",
    "the distributed optimizer rejects params whose type() is not torch.cuda.* and moves its state "
    "to CUDA with .cuda() when gathering it for a checkpoint; tied embeddings with pp > 1 move the "
    "last stage's copy with .cuda() before the first all-reduce",
    [
        UpstreamSite("optimizer/distrib_optimizer.py", 420, "elif model_param.type() == 'torch.cuda.FloatTensor':"),
        UpstreamSite("optimizer/distrib_optimizer.py", 1089, "send_tensor = send_tensor.cuda()"),
        UpstreamSite("models/common/language_module/language_module.py", 244, "weight.data = weight.data.cuda()"),
    ],
)
def _cuda_at_setup_and_checkpoint():
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import distrib_optimizer

    dopt = distrib_optimizer.DistributedOptimizer
    # (owner, attribute) of functions that run at set-up or checkpoint time, never per step
    targets = [(dopt, "_build_model_and_main_param_groups"), (dopt, "get_parameter_state_dp_zero"),
               (dopt, "load_parameter_state_from_dp_zero"), (LanguageModule, "setup_embeddings_and_output_layer")]
    originals = [(owner, attr, owner.__dict__[attr]) for owner, attr in targets]

    def apply() -> None:
        for owner, attr, original in originals:
            setattr(owner, attr, _wrap_in_mode(original))

    def revert() -> None:
        for owner, attr, original in originals:
            setattr(owner, attr, original)

    return apply, revert


# --- 5b. torch.optim.Adam's per-parameter `step` in the distributed optimizer's checkpoints ------
@_register(
    "torch_adam_step_state",
    "without TE/Apex the optimizer is torch.optim.Adam, whose state holds a per-parameter 'step'; the "
    "distributed optimizer saves only param/exp_avg/exp_avg_sq and its loader indexes the saved "
    "tensors by every state key, so loading raises KeyError 'step' (the trainer restores 'step')",
    [UpstreamSite("optimizer/distrib_optimizer.py", 940, "dst_tensors[key].copy_(tensors[key])")],
)
def _torch_adam_step_state():
    from megatron.core.optimizer import distrib_optimizer

    dopt = distrib_optimizer.DistributedOptimizer
    original = dopt.__dict__["_set_main_param_and_optimizer_states"]

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        missing = {k: v for k, v in state.items() if k not in tensors}  # left as they are
        return original(self, model_param, {**missing, **tensors})

    def apply() -> None:
        dopt._set_main_param_and_optimizer_states = set_states

    def revert() -> None:
        dopt._set_main_param_and_optimizer_states = original

    return apply, revert


# --- 6. the fp32 grad-clipping assert ---------------------------------------------------------------
@_register(
    "clip_grad_type_assert",
    "clip_grad_by_total_norm_fp32 asserts every grad is a 'torch.cuda.FloatTensor'",
    [UpstreamSite("optimizer/clip_grads.py", 167, "assert param.grad.type() == 'torch.cuda.FloatTensor'")],
)
def _clip_grad_type_assert():
    from megatron.core.optimizer import clip_grads, optimizer

    original_clip = clip_grads.clip_grad_by_total_norm_fp32

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        """Upstream's scaling (grads *= max_norm / (total_norm + 1e-6) when < 1) without the assert;
        runs every step, so it is a plain function rather than a mode."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    def apply() -> None:
        clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
        optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32

    def revert() -> None:
        clip_grads.clip_grad_by_total_norm_fp32 = original_clip
        optimizer.clip_grad_by_total_norm_fp32 = original_clip

    return apply, revert


# --- 7. the MoE router's gating GEMM without Transformer Engine --------------------------------------
@_register(
    "moe_router_gemm_without_te",
    "RouterGatingLinearFunction tests `te_general_gemm is not None`, but moe_utils binds that name "
    "only when Transformer Engine imports (moe_utils.py:22-39); without TE the router raises "
    "NameError instead of taking its torch.mm branch. Binding the name to None selects that branch",
    [
        UpstreamSite("transformer/moe/moe_utils.py", 1192,
                     "if te_general_gemm is not None and router_dtype != torch.float64:"),
        UpstreamSite("transformer/moe/moe_utils.py", 1225,
                     "if te_general_gemm is not None and ctx.router_dtype != torch.float64:"),
    ],
)
def _moe_router_gemm_without_te():
    from megatron.core.transformer.moe import moe_utils

    bound_upstream = "te_general_gemm" in vars(moe_utils)

    def apply() -> None:
        if not bound_upstream:
            moe_utils.te_general_gemm = None

    def revert() -> None:
        if not bound_upstream:
            vars(moe_utils).pop("te_general_gemm", None)

    return apply, revert


# --- 8. multi-latent attention's TE type check without Transformer Engine ------------------------------
@_register(
    "mla_without_te",
    "multi_latent_attention imports TELinear from megatron.core.extensions.transformer_engine, which "
    "without Transformer Engine binds it to a mock object rather than failing, so HAVE_TE is True and "
    "MultiLatentAttention.__init__'s isinstance(self.linear_proj, TELinear) raises TypeError. HAVE_TE "
    "False (what a failed import would have set) skips that FP8-only branch",
    [
        UpstreamSite("transformer/multi_latent_attention.py", 62, "HAVE_TE = True"),
        UpstreamSite("transformer/multi_latent_attention.py", 185, "and isinstance(self.linear_proj, TELinear)"),
    ],
)
def _mla_without_te():
    from megatron.core.transformer import multi_latent_attention

    upstream = multi_latent_attention.HAVE_TE

    def apply() -> None:
        if importlib.util.find_spec("transformer_engine") is None:
            multi_latent_attention.HAVE_TE = False

    def revert() -> None:
        multi_latent_attention.HAVE_TE = upstream

    return apply, revert


# --- 9. a RoPE table's context-parallel slice through pinned memory ------------------------------------
@_register(
    "pos_emb_cp_rank_pinned",
    "get_pos_emb_on_this_cp_rank builds its two chunk indices with pin_memory=True and .cuda(); YaRN's "
    "embedding calls it at construction under context parallelism (its cos/sin cache), which raises on a "
    "CPU build. The same selection, with the indices on the table's device",
    [
        UpstreamSite("models/common/embeddings/rope_utils.py", 62, "cp_idx = torch.tensor("),
        UpstreamSite("models/common/embeddings/rope_utils.py", 63,
                     '[cp_rank, (2 * cp_size - cp_rank - 1)], device="cpu", pin_memory=True'),
        UpstreamSite("models/common/embeddings/yarn_rotary_pos_embedding.py", 186,
                     "emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)"),
    ],
)
def _pos_emb_cp_rank_pinned():
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    modules = (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding)
    original = rope_utils.get_pos_emb_on_this_cp_rank

    def on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        mine = chunks.index_select(seq_dim, index)
        return mine.view(*mine.shape[:seq_dim], -1, *mine.shape[seq_dim + 2:])

    def apply() -> None:
        for module in modules:
            module.get_pos_emb_on_this_cp_rank = on_this_cp_rank

    def revert() -> None:
        for module in modules:
            module.get_pos_emb_on_this_cp_rank = original

    return apply, revert


# --- 10. mixed precision: the bf16/fp16 optimizer sorts parameters by their CUDA type names ------------------
@_register(
    "float16_optimizer_cpu_params",
    "Float16OptimizerWithFloat16Params keeps an fp32 master copy of each bf16/fp16 parameter, but picks them by "
    "`param.type()` in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'] and raises TypeError for any "
    "other name, a CPU tensor's 'torch.BFloat16Tensor' included: a bf16 model could not train on CPU. While "
    "its constructor runs, a CPU tensor's type() answers with the CUDA name of its dtype; everything after it "
    "(the master copies, the grad copies, the step) is device-neutral torch",
    [
        UpstreamSite("optimizer/optimizer.py", 671,
                     "if param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']:"),
        UpstreamSite("optimizer/optimizer.py", 690, "elif param.type() == 'torch.cuda.FloatTensor':"),
    ],
)
def _float16_optimizer_cpu_params():
    from megatron.core.optimizer import optimizer

    cls = optimizer.Float16OptimizerWithFloat16Params
    original_init, tensor_type = cls.__init__, torch.Tensor.type
    cuda_names = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                  "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}

    def type_as_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = tensor_type(self, *args, **kwargs)
        return cuda_names.get(name, name) if not args and not kwargs else name

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        torch.Tensor.type = type_as_cuda  # type: ignore[method-assign]
        try:
            original_init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = tensor_type  # type: ignore[method-assign]

    def apply() -> None:
        cls.__init__ = init

    def revert() -> None:
        cls.__init__ = original_init

    return apply, revert


# --- public API -------------------------------------------------------------------------------------
def needed() -> bool:
    """The layer is for CPU-only runs; with CUDA, megatron-core runs as upstream intends."""
    return not torch.cuda.is_available()


def patches() -> dict[str, Patch]:
    return dict(_PATCHES)


def activate(force: bool = False) -> list[str]:
    """Apply every patch (idempotent) when CUDA is absent; returns the names applied."""
    if not (force or needed()):
        return []
    for patch in _PATCHES.values():
        if not patch.active:
            patch.apply()
            patch.active = True
    logger.debug("megatron-core CPU compatibility layer active: %s", ", ".join(_PATCHES))
    return list(_PATCHES)


def deactivate() -> None:
    for patch in _PATCHES.values():
        if patch.active:
            patch.revert()
            patch.active = False


@contextlib.contextmanager
def without(name: str) -> Iterator[None]:
    """Temporarily revert one patch (tests use this to show the patch is still needed)."""
    patch = _PATCHES[name]
    was_active = patch.active
    if was_active:
        patch.revert()
        patch.active = False
    try:
        yield
    finally:
        if was_active:
            patch.apply()
            patch.active = True
