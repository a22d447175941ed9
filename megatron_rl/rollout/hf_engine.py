"""The `hf` rollout backend: a `transformers` causal LM and its own `generate`.

It is the CPU default and the numerical reference for the other backends. Weights arrive
from the trainer by weight sync, so the engine starts from whatever architecture the config
describes and never loads a checkpoint itself: as HF-named tensors (`update_weights`), or, in the
trainer's own process, copied straight into its parameters (`weight_targets`, `weights_written`:
`weight_sync.in_place`). Where `transformers` holds weights differently in memory (fused experts),
the family's converter says which slice each hub tensor fills (`hf_memory_slot`); the engine finds
each slice once per allocation (its weights move only in release_memory / resume_memory, which
drop those views). Releasing the "weights" tag really frees them (the module moves to the meta
device); after resuming they hold garbage until the next weight update, exactly like SGLang's
memory saver.

LoRA adapters (`update_adapters`, for `rollout.weight_sync=adapters`) run as forward hooks of the adapted
`torch.nn.Linear` modules, which add (alpha / r) B (A x) to their output as the trainer's adapters do, on top
of whatever base weights the modules hold. Written here rather than with PEFT: PEFT wraps each adapted module
(its weight becomes `...q_proj.base_layer.weight`), which would rename the parameters that weight updates
address by their hub names.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch

from megatron_rl.rollout.base import (  # noqa: F401  (EngineStateError: re-exported)
    ALL_TAGS, TAG_KV_CACHE, TAG_WEIGHTS, EngineStateError, Generation, SamplingParams, WeightRegion,
    covered_once, region_view)

logger = logging.getLogger(__name__)


def _latent_norms_as_megatron(model: torch.nn.Module, model_cfg: Any) -> None:
    """transformers builds DeepSeek-V3's latent norms (q_a_layernorm, kv_a_layernorm) with eps 1e-6 whatever
    rms_norm_eps says (modeling_deepseek_v3.py:380, 392); Megatron-core's multi-latent attention, and SGLang,
    use rms_norm_eps. The same for DeepSeek-V3 and Kimi-K2 (1e-6), not for Moonlight (1e-5): the engine takes
    the trainer's, so that its log-probs stay the trainer's."""
    if not model_cfg.multi_latent_attention:
        return
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm):
            if norm is not None:
                norm.variance_epsilon = model_cfg.norm_eps


class _RoutingCapture:
    """The experts a generate call routed every token to. transformers' MoE routers (`*TopKRouter` /
    `*TopkRouter` modules, one per MoE layer, every family here) return (logits, weights, indices): a
    forward hook keeps the indices of each call, the prefill's [rows * width, k] and each decoding
    step's [rows, k] (step j feeds response token j - 1)."""

    def __init__(self, model: torch.nn.Module, rows: int) -> None:
        self.rows = rows
        found = []
        for name, module in model.named_modules():
            if type(module).__name__.lower().endswith("topkrouter"):
                found.append((int(name.split("layers.")[1].split(".")[0]), module))
        if not found:
            raise ValueError(f"return_routing: {type(model).__name__} has no MoE router")
        self.routers = [module for _, module in sorted(found, key=lambda item: item[0])]
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]

    def __enter__(self) -> "_RoutingCapture":
        self.handles = [router.register_forward_hook(  # kept on the device: no host sync per call
            lambda module, args, out, calls=calls: calls.append(out[2].detach().to(torch.int16)))
            for router, calls in zip(self.routers, self.calls)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        # per layer, on the host: the prefill [rows, width, k] and the decoding steps [rows, steps, k]
        self.prefill = [calls[0].view(self.rows, -1, calls[0].shape[-1]).cpu() for calls in self.calls]
        self.steps = [torch.stack([c.view(self.rows, -1) for c in calls[1:]], dim=1).cpu() if len(calls) > 1
                      else calls[0].new_zeros((self.rows, 0, calls[0].shape[-1])).cpu() for calls in self.calls]

    def routing(self, row: int, pad: int, length: int) -> torch.Tensor:
        """Row `row`'s [prompt + length - 1, layers, k]: its prompt (after `pad` columns of left padding),
        then its first length - 1 response tokens."""
        return torch.stack([torch.cat([prefill[row, pad:], steps[row, :max(length - 1, 0)]])
                            for prefill, steps in zip(self.prefill, self.steps)], dim=1)


class _Adapter:
    """One linear layer's LoRA adapter in the engine: its forward hook adds scaling * B (A x)."""

    def set(self, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        self.a, self.b, self.scaling = a.contiguous(), b.contiguous(), scaling

    def hook(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + torch.nn.functional.linear(torch.nn.functional.linear(args[0], self.a), self.b) * self.scaling


def chosen_logprobs(scores: torch.Tensor, tokens: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
    """log softmax(scores / temperature)[row, tokens[row]] in fp32, [rows], with the normaliser's log-sum-exp
    combined over blocks of `chunk` columns."""
    blocks = [torch.logsumexp(scores[:, i:i + chunk].float() / temperature, dim=-1)
              for i in range(0, scores.shape[-1], chunk)]
    normaliser = blocks[0] if len(blocks) == 1 else torch.logsumexp(torch.stack(blocks, dim=-1), dim=-1)
    return scores.gather(-1, tokens[:, None])[:, 0].float() / temperature - normaliser


class _Sampler:
    """Draws each step's tokens itself, as a logits processor of a greedy `generate`: it sees the step's raw
    logits (greedy decoding adds no warpers, and the engine's model, built from its config, has a neutral
    generation config), keeps the chosen token's log-prob at `params.logprob_temperature`, and returns
    scores that are -inf but at the chosen token, which generate's argmax then takes. Sampling applies
    transformers' own temperature, top-k and top-p warpers and one `multinomial` on the global generator, as
    `generate(do_sample=True)` does, so a seeded call gives the tokens plain transformers would. What is
    kept is one [rows] log-prob tensor per step (`output_logits=True` kept every step's [rows, vocab]
    logits: memory growing as rows x steps x vocab). Temperature 0 is the argmax, with no multinomial.
    Everything stays on the engine's device: the log-prob is the chosen logit less a log-sum-exp taken over
    `chunk` vocabulary columns at a time (no [rows, vocab] log-softmax), and the returned scores are
    generate's own tensor, overwritten in place; the host sees the [rows, steps] log-probs once, at the end."""

    CHUNK = 32768  # vocabulary columns per log-sum-exp block: [rows, 32768] fp32 at most besides the scores

    def __init__(self, params: SamplingParams) -> None:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.greedy, self.temperature = params.greedy, params.logprob_temperature
        warpers = [] if params.greedy else [
            *([TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []),
            *([TopKLogitsWarper(params.top_k)] if params.top_k > 0 else []),
            *([TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else [])]
        self.warpers = LogitsProcessorList(warpers)
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            tokens = scores.argmax(-1)
        else:
            tokens = torch.multinomial(torch.softmax(self.warpers(input_ids, scores), dim=-1), num_samples=1)[:, 0]
        self.logprobs.append(chosen_logprobs(scores, tokens, self.temperature, self.CHUNK))
        return scores.fill_(float("-inf")).scatter_(1, tokens[:, None], 0.0)  # generate's argmax takes `tokens`

    def stacked(self, rows: int) -> torch.Tensor:
        """[rows, steps] on the host."""
        return torch.stack(self.logprobs, dim=1).cpu() if self.logprobs else torch.zeros(rows, 0)


class _ResponseStopStrings:
    """A stopping criterion of `generate`: a row ends once its response's text holds one of `stops`. Not
    transformers' `stop_strings`, whose StopStringCriteria matches the end of the whole sequence, prompt included:
    a stop string begun by the prompt's last characters would end the row at a response that holds none (then
    padded with tokens the model never sampled), where SGLang, which matches the response's text, goes on. Only the
    response's last tokens are decoded: one a character at least, so a string just completed lies in them."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], width: int) -> None:
        self.tokenizer, self.stops, self.width = tokenizer, tuple(stops), width
        self.window = 2 * max(len(s) for s in stops) + 8  # tokens; slack for tokens decoding to nothing

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        tails = input_ids[:, self.width:][:, -self.window:].tolist()
        return torch.tensor([any(s in self.tokenizer.decode(tail, skip_special_tokens=False) for s in self.stops)
                             for tail in tails], dtype=torch.bool, device=input_ids.device)


class HFEngine:
    def __init__(self, model_cfg: Any, *, device: str | torch.device = "cpu", eos_token_id: int = 0,
                 pad_token_id: int = 0, max_batch_size: int = 256, tokenizer: Any = None) -> None:
        from megatron_rl.models.gpt import torch_dtype
        from megatron_rl.models.hf import build_hf_model, fp32_tensors, kept_in_fp32
        from megatron_rl.families import get_converter

        self.device = torch.device(device)
        # the trainer's dtype: weight sync then copies without converting
        self.model = build_hf_model(model_cfg, seed=0, eos_token_id=eos_token_id).to(
            self.device, torch_dtype(model_cfg.dtype))
        # What transformers keeps in fp32 in any dtype, as from_pretrained would (GLM-4.5's router
        # weight and selection bias; the trainer keeps the bias in fp32 too, and a bf16 copy of it
        # could change which experts are chosen).
        keep = fp32_tensors(self.model.config)
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if kept_in_fp32(name, keep):
                tensor.data = tensor.data.float()
        _latent_norms_as_megatron(self.model, model_cfg)
        self.model.generation_config.pad_token_id = pad_token_id
        self.model_cfg = model_cfg
        # Weight sync sends the hub layout; transformers may hold it differently (fused experts).
        self._converter = get_converter(model_cfg.family)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.tokenizer = tokenizer  # for stop strings
        self.weight_version = 0
        # parameters no update has written since they were last allocated (random init, or
        # uninitialised memory after release_memory / resume_memory): a flush leaving any is an error
        self._unwritten = {name for name, _ in self.model.named_parameters()}
        # of those, the ones held fused (`hf_memory_slot`: transformers' stacked experts) that updates have written in
        # part: {parameter: {hub name: elements of its slice}}; a parameter counts as written once its slices
        # (disjoint: one per hub tensor) cover all its elements, so an update that skips one expert is refused too
        self._partly_written: dict[str, dict[str, int]] = {}
        # views of the weights, made once per allocation (`_slot`, `weight_targets`)
        self._held: dict[str, torch.Tensor] = {}
        self._slots: dict[str, tuple[str, torch.Tensor]] = {}
        self._targets: Optional[tuple[weakref.ref, list[torch.Tensor]]] = None
        self._checked: Optional[weakref.ref] = None  # the plan whose regions were found to cover every parameter
        self._released: set[str] = set()
        self._paused = threading.Event()
        self._weights_valid = False  # random init until the first update
        self._buffers: dict[str, torch.Tensor] = {}
        self._adapters: dict[str, _Adapter] = {}  # HF module name -> its LoRA adapter (update_adapters)
        self.generated_tokens = 0

    # -- weights ------------------------------------------------------------------------------
    def weight_slot(self, name: str) -> torch.Tensor:
        """The engine's memory that the hub tensor `name` fills: a view of its parameter (or buffer), with the hub
        tensor's shape (`hf_memory_slot`: a slice of a fused tensor). Valid until the weights are released."""
        return self._slot(name)[1]

    @torch.no_grad()  # views of parameters that require grad: made outside autograd, as the copies into them
    def _slot(self, name: str) -> tuple[str, torch.Tensor]:
        """(the parameter or buffer that holds `name`, `weight_slot(name)`), found once per allocation."""
        slot = self._slots.get(name)
        if slot is None:
            if not self._held:  # tied lm_head included
                self._held = {**dict(self.model.named_buffers()),
                              **dict(self.model.named_parameters(remove_duplicate=False))}
            held, index = self._converter.hf_memory_slot(name, self.model_cfg)
            if held not in self._held:
                raise ValueError(f"weight update names {name!r}, which the {type(self.model).__name__} "
                                 f"engine does not have")
            slot = self._slots[name] = (held, self._held[held][index])
        return slot

    def _forget_slots(self) -> None:
        """Drop every view of the weights (they would keep released memory alive, or point at freed memory)."""
        self._held, self._slots, self._targets = {}, {}, None

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       flush: bool = True) -> None:
        if TAG_WEIGHTS in self._released:
            raise EngineStateError("update_weights while the weights are released: resume_memory(['weights']) first")
        for name, tensor in named_tensors:
            held, target = self._slot(name)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight update {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the engine expects {tuple(target.shape)}")
            target.copy_(tensor)  # converts the dtype as it copies
            if held in self._unwritten:
                parts = self._partly_written.setdefault(held, {})
                parts[name] = target.numel()
                if sum(parts.values()) >= self._held[held].numel():
                    self._unwritten.discard(held)
                    del self._partly_written[held]
        if flush:
            if self._unwritten:
                missing = sorted(self._unwritten)
                raise EngineStateError(
                    f"weight update {version} left {len(missing)} engine parameters unwritten since they were "
                    f"allocated (e.g. {', '.join(missing[:3])}): the update must send every weight")
            self._loaded(version)

    @torch.no_grad()
    def weight_targets(self, regions: Sequence[WeightRegion], plan: object) -> list[torch.Tensor]:
        """Views of the engine's memory that an in-place weight sync (`weight_sync.in_place`) copies into, one per
        region (hub name, shape to view its slot as or None, index). Made and checked once per allocation for
        `plan` and kept until the weights are released: a region must fit its slot, and together the regions
        must write every element of every parameter (counted: a plan that skips one fails here, loudly)."""
        if TAG_WEIGHTS in self._released:
            raise EngineStateError("weight sync while the weights are released: resume_memory(['weights']) first")
        if self._targets is not None and self._targets[0]() is plan:
            return self._targets[1]
        views, written = [], collections.defaultdict(list)
        for region in regions:
            held, slot = self._slot(region[0])
            try:
                views.append(region_view(slot, region))
            except (RuntimeError, IndexError) as exc:
                raise ValueError(f"weight sync region {region} does not fit the engine's {tuple(slot.shape)} "
                                 f"tensor: {exc}") from exc
            written[held].append(views[-1])
        if self._checked is None or self._checked() is not plan:  # the same regions in new memory: checked once
            wrong = [f"{name} ({sum(v.numel() for v in written[name])} writes for {p.numel()} elements)"
                     for name, p in self.model.named_parameters() if not covered_once(p, written[name])]
            if wrong:
                raise ValueError(f"weight sync does not write {len(wrong)} engine parameters exactly once "
                                 f"(e.g. {', '.join(wrong[:3])}): the plan must cover every weight")
            self._checked = weakref.ref(plan)
        self._targets = (weakref.ref(plan), views)
        return views

    def weights_written(self, version: int, plan: object) -> None:
        """`plan` has copied into every view `weight_targets` gave it: `version` takes effect."""
        if self._targets is None or self._targets[0]() is not plan:
            raise EngineStateError(f"weights_written({version}): the weights were reallocated since the plan's "
                                   "weight_targets (release / resume), so its copies did not reach them")
        self._unwritten.clear()
        self._partly_written.clear()
        self._loaded(version)

    def _loaded(self, version: int) -> None:
        self.weight_version = version
        self._weights_valid = True

    @torch.no_grad()
    def update_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float,
                        version: int) -> None:
        """LoRA adapters {HF module name: (A [r, in], B [out, r])} on the base weights a full update loaded:
        each named linear then computes W x + scaling B A x. The first call attaches them; later calls must name
        the same modules and replace their factors. `version` takes effect."""
        if TAG_WEIGHTS in self._released:
            raise EngineStateError("update_adapters while the weights are released: resume_memory(['weights']) "
                                   "and a full weight update first")
        if not self._weights_valid:
            raise EngineStateError("update_adapters before any weight update: the engine needs the base weights "
                                   "first (a full weight update)")
        if self._adapters and set(adapters) != set(self._adapters):
            raise ValueError(f"update_adapters names {len(adapters)} modules, the engine's adapters "
                             f"{len(self._adapters)}: an update must replace every adapter")
        modules = dict(self.model.named_modules())
        for name, (a, b) in adapters.items():
            linear = modules.get(name)
            if not isinstance(linear, torch.nn.Linear):
                raise ValueError(f"adapter update names {name!r}, which is no linear layer of the "
                                 f"{type(self.model).__name__} engine")
            out_features, in_features = linear.weight.shape
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
                    or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter of {name!r}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit its "
                                 f"weight {tuple(linear.weight.shape)} (A [r, in], B [out, r])")
        for name, (a, b) in adapters.items():
            linear = modules[name]
            adapter = self._adapters.get(name)
            if adapter is None:
                adapter = self._adapters[name] = _Adapter()
                linear.register_forward_hook(adapter.hook)
            adapter.set(a.to(linear.weight.device, linear.weight.dtype),
                        b.to(linear.weight.device, linear.weight.dtype), scaling)
        self.weight_version = version

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in the hub layout (the names and shapes weight sync sends)."""
        from megatron_rl.models.hf import hub_state_dict

        return {k: v.detach().clone() for k, v in hub_state_dict(self.model).items()}

    # -- memory -------------------------------------------------------------------------------
    def release_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        if TAG_WEIGHTS in tags and TAG_WEIGHTS not in self._released:
            # Non-persistent buffers (rotary inv_freq) are not part of weight sync: keep them.
            self._buffers = {n: b.detach().cpu().clone() for n, b in self.model.named_buffers()}
            self._forget_slots()
            self.model.to("meta")  # frees every parameter and buffer
            self._weights_valid = False
        self._released |= set(tags)

    def resume_memory(self, tags: Sequence[str] = ALL_TAGS) -> None:
        if TAG_WEIGHTS in tags and TAG_WEIGHTS in self._released:
            self.model.to_empty(device=self.device)  # allocated, uninitialised: sync weights next
            # to_empty gives each tied parameter storage of its own: tie them again (a tied lm_head is the
            # embedding, which weight sync sends once)
            self.model.tie_weights()
            self._forget_slots()
            self._unwritten = {name for name, _ in self.model.named_parameters()}
            self._partly_written = {}
            with torch.no_grad():
                for name, buf in self.model.named_buffers():
                    buf.copy_(self._buffers[name])
        self._released -= set(tags)

    # -- requests -----------------------------------------------------------------------------
    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def abort(self) -> None:
        """Generation here is synchronous: nothing is ever in flight between calls."""

    def health(self) -> dict:
        return {"backend": "hf", "weight_version": self.weight_version, "released": sorted(self._released),
                "adapters": len(self._adapters),
                "paused": self._paused.is_set(), "weights_valid": self._weights_valid,
                "generated_tokens": self.generated_tokens}

    def shutdown(self) -> None:
        self.release_memory(ALL_TAGS)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop} need the engine's tokenizer (HFEngine(tokenizer=...))")
        if self._released & {TAG_WEIGHTS, TAG_KV_CACHE}:
            raise EngineStateError(f"generate while memory is released ({sorted(self._released)}): resume_memory first")
        if self._paused.is_set():
            raise EngineStateError("generate while paused: resume() first")
        if not self._weights_valid:
            raise EngineStateError("generate before any weight update: sync weights from the trainer first")
        jobs = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(params.n)]
        out: list[Generation] = []
        # a seeded request leaves the global generator as it was; an unseeded one draws from it (forking
        # it too would give every unseeded call the same samples)
        with torch.random.fork_rng(devices=[], enabled=params.seed is not None):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(jobs), self.max_batch_size):
                out += self._generate_batch(jobs[start:start + self.max_batch_size], params)
        return out

    def _stop_string_end(self, tokens: list[int], stops: Sequence[str]) -> Optional[int]:
        """The shortest prefix length whose text holds one of `stops`, or None (a binary search: a
        longer prefix's text holds what a shorter one's does)."""
        def holds(n: int) -> bool:
            text = self.tokenizer.decode(tokens[:n], skip_special_tokens=False)
            return any(s in text for s in stops)
        if not tokens or not holds(len(tokens)):
            return None
        low, high = 1, len(tokens)
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if holds(mid) else (mid + 1, high)
        return low

    def _generate_batch(self, jobs: list[tuple[int, list[int]]], params: SamplingParams) -> list[Generation]:
        width = max(len(p) for _, p in jobs)
        ids = torch.full((len(jobs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, (_, prompt) in enumerate(jobs):  # left padding: every prompt ends at the same column
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        stop = sorted(set(params.stop_token_ids) | {self.eos_token_id})
        start = time.perf_counter()
        from transformers import LogitsProcessorList, StoppingCriteriaList

        criteria = [_ResponseStopStrings(self.tokenizer, params.stop, width)] if params.stop else []
        strings = dict(stopping_criteria=StoppingCriteriaList(criteria)) if criteria else {}

        sampler = _Sampler(params)
        with _RoutingCapture(self.model, len(jobs)) if params.return_routing else contextlib.nullcontext() as capture:
            sequences = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False, temperature=None,
                top_p=None, top_k=None, logits_processor=LogitsProcessorList([sampler]),
                max_new_tokens=params.max_new_tokens, eos_token_id=stop, pad_token_id=self.pad_token_id, **strings)
        new = sequences[:, width:]
        logprobs = sampler.stacked(len(jobs))
        new = new.cpu()
        generations = []
        for row, (prompt_index, _) in enumerate(jobs):
            tokens = new[row].tolist()
            length, reason = len(tokens), "length"
            for pos, tok in enumerate(tokens):
                if tok in stop:
                    length, reason = pos + 1, "stop"
                    break
            if params.stop:  # a stop string ends the response at the token completing it
                cut = self._stop_string_end(tokens[:length], params.stop)
                if cut is not None:
                    length, reason = cut, "stop"
            generations.append(Generation(prompt_index, tokens[:length], logprobs[row, :length].tolist(),
                                          reason, self.weight_version))
            if capture is not None:
                generations[-1].routing = capture.routing(row, width - len(jobs[row][1]), length)
            self.generated_tokens += length
        logger.debug("hf engine: %d sequences in %.3fs", len(jobs), time.perf_counter() - start)
        return generations
