"""The rollout engine protocol: token ids in, token ids + per-token log-probs + finish
reason + the weight version that produced them out.

Log-probs are those of the sampling distribution before truncation: log_softmax(logits /
temperature) of the chosen token (top-p / top-k change which tokens can be drawn, not the
reported log-prob). The trainer recomputes log-probs with the same temperature, so with
unchanged weights the importance ratio of the first update is 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

import torch

# Where an in-place weight sync copies one view of a Megatron tensor: (hub name of the engine tensor, the shape to
# view that tensor as or None, an index into it) (`InPlaceEngine.weight_targets`)
WeightRegion = tuple[str, Optional[tuple[int, ...]], tuple]


def region_view(slot: torch.Tensor, region: WeightRegion) -> torch.Tensor:
    """The view of the engine memory `slot` (the hub tensor `region[0]`'s) that `region` names."""
    _, shape, index = region
    return (slot if shape is None else slot.view(shape))[index]


# Memory tags, as SGLang names them: model weights and the KV cache are released separately.
TAG_WEIGHTS = "weights"
TAG_KV_CACHE = "kv_cache"
ALL_TAGS = (TAG_WEIGHTS, TAG_KV_CACHE)


class EngineStateError(RuntimeError):
    """A call that the engine's memory or pause state does not allow (e.g. generate while released)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy (argmax), as in SGLang and vLLM; its log-probs are at temperature 1
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k truncation
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the response ends with the token that completes one (kept)
    n: int = 1  # samples per prompt
    seed: Optional[int] = None
    return_routing: bool = False  # a mixture of experts: each Generation's `routing` (rollout routing replay)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the log-probs of the sampled tokens are computed at: the sampling temperature, or 1 for
        greedy decoding (SGLang's greedy path reports them so)."""
        return self.temperature or 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy decoding)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1 or self.n < 1:
            raise ValueError("max_new_tokens and n must be >= 1")


@dataclasses.dataclass
class Generation:
    """One sampled completion of one prompt."""

    prompt_index: int  # index of its prompt in the request
    output_ids: list[int]
    logprobs: list[float]  # one per output token
    finish_reason: str  # "stop" (a stop/eos token, included in output_ids) or "length" or "abort"
    weight_version: int
    # SamplingParams.return_routing: the experts every token fed to the model was routed to, prompt and
    # response but the last response token, [len(prompt) + len(output_ids) - 1, MoE layers, top k] int16
    routing: Optional[torch.Tensor] = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from an inference engine."""

    weight_version: int

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """`params.n` completions per prompt, ordered by prompt then sample."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush: bool = True) -> None:
        """Load HF-named tensors (a bucket of them; call repeatedly); `version` stamps what
        generates next. `flush=False` for all buckets but the last of one update."""

    def update_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
                        version: int) -> None:
        """Optional (engines that serve rollout.weight_sync=adapters: hf, sglang). LoRA adapters
        {HF module name: (A [r, in], B [out, r])} on the base weights the last `update_weights` loaded: each
        module then computes W x + scaling B A x; later calls replace them. `version` stamps what generates
        next."""

    def release_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        """Free the tagged regions; a region released already stays so (no error: the colocation controller's
        hand-back releases everything, whatever a failed rollout had resumed)."""

    def resume_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        """Allocate the tagged regions again; a resident region stays as it is."""

    def pause(self) -> None:
        """Stop taking new requests (in-flight ones finish)."""

    def resume(self) -> None: ...

    def abort(self) -> None:
        """Abort in-flight requests; they return with finish_reason "abort"."""

    def health(self) -> dict: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class InPlaceEngine(Protocol):
    """An engine in the trainer's process whose weights weight sync copies into directly, with no HF tensors or
    buckets in between (`weight_sync.in_place`; the hf backend)."""

    def weight_slot(self, name: str) -> torch.Tensor:
        """The engine memory that the hub tensor `name` fills (a view, of the hub tensor's shape)."""

    def weight_targets(self, regions: Sequence[WeightRegion], plan: object) -> list[torch.Tensor]:
        """A view of the engine's memory per region, kept for `plan` until the weights are released; raises
        ValueError unless the regions write every element of every parameter."""

    def weights_written(self, version: int, plan: object) -> None:
        """`plan` copied into all of its `weight_targets`: `version` takes effect."""


def covered_once(tensor: torch.Tensor, views: Sequence[torch.Tensor]) -> bool:
    """Whether `views` of the contiguous `tensor`'s memory hold each of its elements exactly once (the check of an
    in-place weight sync's copies, on both sides, once per plan). Counted on the host, a block at a time: the
    largest block that every view's contiguous runs, starts and strides are made of (a row for row slices)."""
    storage = tensor.untyped_storage().data_ptr()
    if not tensor.is_contiguous() or sum(v.numel() for v in views) != tensor.numel() \
            or any(v.untyped_storage().data_ptr() != storage for v in views):
        return False
    if len(views) == 1 and _dense(views[0]):  # as many distinct elements as the tensor has, all of them its own
        return True
    shapes = [(*_runs(v), v.storage_offset() - tensor.storage_offset()) for v in views if v.numel()]
    block = math.gcd(tensor.numel(), *(run for _, run, _ in shapes), *(start for _, _, start in shapes),
                     *(stride for outer, _, _ in shapes for _, stride in outer))
    marks = torch.zeros(tensor.numel() // block, dtype=torch.uint8)
    try:
        for outer, run, start in shapes:
            marks.as_strided([size for size, _ in outer] + [run // block],
                             [stride // block for _, stride in outer] + [1], start // block).add_(1)
    except RuntimeError:  # a view that holds some element twice, or reaches beyond the tensor
        return False
    return bool((marks == 1).all())


def _runs(view: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
    """`view` as (outer dims (size, stride), the length of the contiguous run its innermost dims make)."""
    dims = [(size, stride) for size, stride in zip(view.shape, view.stride()) if size != 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    return dims, run


def _dense(view: torch.Tensor) -> bool:
    """Whether `view`'s elements are distinct and fill a contiguous span (a permutation of a contiguous tensor)."""
    step = 1
    for stride, size in sorted((st, sz) for sz, st in zip(view.shape, view.stride()) if sz != 1):
        if stride != step:
            return False
        step *= size
    return True
