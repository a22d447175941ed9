"""Training-step throughput: tokens/s of `Trainer.train_step` (policy-gradient loss, packed
micro-batches) for the baseline path (logits from the output layer, then log-softmax) and
the variants, side by side in the same run, as ratios; MFU on GPU.

    python benchmarks/train_step.py [--model tiny_qwen2] [--samples 32] [--length 256] [--steps 5]
        [--device cpu|cuda] [--peak-tflops 989]

The last arm is the baseline a TRL user gets: `transformers`' model of the same architecture (its own random
weights, the same dtype and device), all samples in one forward and backward right-padded to the longest
with an attention mask, as TRL's `GRPOTrainer` runs a batch, the same clipped policy-gradient loss per token
from a log-softmax of the logits, then an Adam step (`--no-transformers` leaves it out).

Variants: fused log-probs (model.fused_logprobs=true), full activation recomputation
(model.recompute=full), LoRA adapters of rank --lora-rank with fused log-probs (model.lora_rank: the
frozen weights get no gradients nor optimizer state; the column "grads+optim" shows what each variant
holds); on CPU also the local spec's dense-mask attention (Megatron-core's DotProductAttention over whole
rows, what the CPU path ran before `PackedAttention`).

MFU = 6 * active parameters * tokens / time / peak (the dense-transformer estimate that ignores
attention's quadratic term; for a mixture of experts only the routed experts a token goes through
count, topk / num_experts of them, and an untied input embedding, a lookup, not at all;
`--peak-tflops` is the device's dense bf16 peak, 989 for an H100/H200 SXM). With LoRA the frozen weights'
gradient products are skipped: 4 instead of 6 (the adapters' own products are left out).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny_qwen2")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--hidden", type=int, default=None, help="override the model's hidden size (ffn = 3x)")
    p.add_argument("--layers", type=int, default=None, help="override the model's number of layers")
    p.add_argument("--lora-rank", type=int, default=16, help="the LoRA variant's rank (0: no LoRA variant)")
    p.add_argument("--transformer-impl", default="auto", choices=["auto", "transformer_engine", "local"],
                   help="model.transformer_impl (local: Megatron's local spec, also on a GPU without TE)")
    p.add_argument("--no-transformers", action="store_true", help="leave out the transformers arm")
    p.add_argument("--lengths", default=None, help="min:max: sample lengths drawn uniformly (default: all --length)")
    args = p.parse_args()

    from megatron_rl.algorithms.objective import make_policy_loss_fn
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.config.schema import AlgorithmConfig, OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    # the architecture of conf/model/<model>.yaml with random weights: no checkpoint, no tokenizer files
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    overrides = [f"model={args.model}", "model.path=null", "model.tokenizer=builtin:char", f"model.dtype={dtype}",
                 f"model.transformer_impl={args.transformer_impl}"]
    if args.hidden:
        overrides += [f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={3 * args.hidden}"]
    if args.layers:
        overrides.append(f"model.num_layers={args.layers}")
    try:
        base = load_config(overrides, world_size=1).model
    except ConfigError as exc:
        p.error(str(exc))
    device = torch.device(args.device)
    mdist.init_distributed(mdist.dist_env_from({}), device)
    groups = state.initialize(1, 1, device=device)
    gen = torch.Generator().manual_seed(0)
    samples = []
    low, high = (int(x) for x in args.lengths.split(":")) if args.lengths else (args.length, args.length)
    for _ in range(args.samples):
        length = int(torch.randint(low, high + 1, (1,), generator=gen))
        tokens = torch.randint(0, base.vocab_size, (length,), generator=gen)
        n = length - 1
        extras = {"advantages": torch.randn(n, generator=gen), "old_logprobs": torch.full((n,), -5.0),
                  "rollout_logprobs": torch.full((n,), -5.0)}
        samples.append(Sample(tokens, torch.ones(n), extras))
    loss_fn = make_policy_loss_fn(AlgorithmConfig())
    variants = {"baseline (logits + log-softmax)": dict(fused_logprobs=False),
                "fused log-probs": dict(fused_logprobs=True),
                "recompute=full": dict(fused_logprobs=False, recompute="full")}
    if args.lora_rank:
        variants[f"LoRA r={args.lora_rank} + fused log-probs"] = dict(fused_logprobs=True, lora_rank=args.lora_rank,
                                                                     lora_alpha=2.0 * args.lora_rank)
    if device.type == "cpu":
        variants["dense-mask attention"] = dict(fused_logprobs=False, dense_attention=True)
    if not args.no_transformers:
        variants["transformers, one padded batch"] = dict(transformers=True)
    results = {}
    for name, change in variants.items():
        change = dict(change)
        if change.pop("transformers", False):
            results[name] = transformers_arm(base, samples, args.steps, device)
            base_tps = next(iter(results.values()))[1]
            step, tps = results[name][:2]
            print(f"{name:34s} {step * 1e3:9.1f} ms/step {tps:11.0f} tokens/s  x{tps / base_tps:.2f}", flush=True)
            ours = results.get("fused log-probs")
            if ours:
                print(f"fused log-probs (the default) / transformers: tokens/s x{ours[1] / tps:.2f}", flush=True)
            print("RESULT " + json.dumps({"variant": name, "ms_per_step": step * 1e3, "tokens_per_s": tps,
                                          "vs_first": tps / base_tps,
                                          "default_vs_transformers": ours[1] / tps if ours else None}), flush=True)
            continue
        dense = change.pop("dense_attention", False)
        cfg = dataclasses.replace(base, **change)
        with dense_mask_attention() if dense else contextlib.nullcontext():
            trainer = Trainer(cfg, OptimizerConfig(lr=1e-5), groups,
                              TrainerOptions(micro_batch_tokens=args.micro_batch_tokens))
        trainer.initialize_weights()
        params, active = parameter_counts(trainer.module, cfg)
        use_te = trainer.use_te
        trainer.train_step(samples, loss_fn)  # warm-up
        times = []
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            trainer.train_step(samples, loss_fn)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step = statistics.median(times)
        tokens = sum(len(sample.tokens) for sample in samples)
        flops_per_param = 4 if cfg.lora_rank else 6
        plan = trainer.memory_plan()
        results[name] = (step, tokens / step, flops_per_param * active * tokens / step / (args.peak_tflops * 1e12),
                         (plan["grads"] + plan["optimizer"]) / 2**20)
        del trainer
        gc.collect()  # the next variant's model and optimizer take the device memory this one held
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if len(results) == 1:  # each line as soon as it is known: a run cut short keeps what it measured
            print(f"{args.model}: {params / 1e6:.1f}M parameters ({active / 1e6:.1f}M active per token), "
                  f"{args.samples} samples of {low}-{high} tokens per step, device {args.device}, {base.dtype}, "
                  f"{'TE' if use_te else 'local'} spec, median of {args.steps} steps", flush=True)
        base_tps = next(iter(results.values()))[1]
        step, tps, mfu, state_mb = results[name]
        line = (f"{name:34s} {step * 1e3:9.1f} ms/step {tps:11.0f} tokens/s  x{tps / base_tps:.2f}"
                f"  grads+optim {state_mb:9.1f} MB")
        if device.type == "cuda":
            line += f"  MFU {mfu:.1%}"
        print(line, flush=True)
        print("RESULT " + json.dumps({"variant": name, "spec": "te" if use_te else "local", "params": params,
                                      "ms_per_step": step * 1e3, "tokens_per_s": tps, "vs_first": tps / base_tps,
                                      "mfu": mfu if device.type == "cuda" else None}), flush=True)


def transformers_arm(model_cfg, samples, steps: int, device: torch.device) -> tuple[float, float]:
    """(median s/step, tokens/s) of `transformers`' model trained on `samples` as TRL's GRPOTrainer trains a
    batch: one right-padded forward and backward with an attention mask, PPO's clipped loss (clip 0.2) over the
    real target tokens, an Adam step. Tokens/s counts the samples' own tokens, not the padding."""
    from megatron_rl.models.gpt import torch_dtype
    from megatron_rl.models.hf import build_hf_model

    model = build_hf_model(model_cfg, seed=0).to(device=device, dtype=torch_dtype(model_cfg.dtype)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    longest = max(len(sample.tokens) for sample in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    advantages, old = torch.zeros(len(samples), longest - 1), torch.zeros(len(samples), longest - 1)
    for i, sample in enumerate(samples):
        n = len(sample.tokens)
        ids[i, :n], mask[i, :n] = sample.tokens, 1
        advantages[i, :n - 1], old[i, :n - 1] = sample.extras["advantages"], sample.extras["old_logprobs"]
    ids, mask, advantages, old = (t.to(device) for t in (ids, mask, advantages, old))
    targets, real = ids[:, 1:], mask[:, 1:].float()

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logprobs = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        ratio = torch.exp(logprobs - old)
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
        ((per_token * real).sum() / real.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return median, sum(len(sample.tokens) for sample in samples) / median


@contextlib.contextmanager
def dense_mask_attention():
    """Build a trainer whose local spec keeps Megatron-core's DotProductAttention and whose rows carry a
    dense [S, S] mask (the CPU path before `PackedAttention`), for comparison."""
    from unittest import mock

    with mock.patch("megatron_rl.models.gpt.uses_packed_attention", return_value=False), \
            mock.patch("megatron_rl.trainer.core.uses_packed_attention", return_value=False):
        yield


def parameter_counts(module: torch.nn.Module, model_cfg) -> tuple[int, int]:
    """(all parameters, those one token's matrix products go through): of a mixture of experts' routed
    experts (`local_experts`) a token uses moe_router_topk of num_experts; the input embedding is a
    lookup (counted only when tied to the output layer, whose product it is too); the rest counts whole."""
    from megatron_rl.models.lora import is_adapter_param

    total = routed = lookup = 0
    for name, p in module.named_parameters():
        if is_adapter_param(name):  # LoRA's adapters: not the model's
            continue
        total += p.numel()
        if ".local_experts." in name:
            routed += p.numel()
        elif name.endswith("embedding.word_embeddings.weight") and not model_cfg.tie_word_embeddings:
            lookup += p.numel()
    active = total - lookup - routed + (routed * model_cfg.moe_router_topk // model_cfg.num_experts if routed else 0)
    return total, active


if __name__ == "__main__":
    main()
