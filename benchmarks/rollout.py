"""Rollout throughput: generated tokens/s of the rollout engines on the same prompts, side by
side in the same run, as ratios against one prompt per `generate` call on the `hf` engine (what
a plain sampling loop does).

    python benchmarks/rollout.py [--prompts 64] [--prompt-tokens 32] [--new-tokens 64] [--n 4]
        [--device cpu|cuda] [overrides ...]

`overrides` are the main job's Hydra overrides (`model=...`, `rollout=sglang`, `rollout.*`):
the configured engine is measured too when it is not the `hf` default (run with a Python that
has SGLang, e.g. the SGLang test venv on CPU). Weights are a seeded random initialisation
pushed into each engine through its weight-update call, as weight sync does; sampling at
temperature 1 with `n` samples per prompt, stopping at end-of-sequence or `--new-tokens`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _measure(engine, prompts, params, repeats: int) -> tuple[float, int]:
    """(median seconds per generate call over all prompts, tokens generated per call)."""
    engine.generate(prompts[:2], params)  # warm-up
    times, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        times.append(time.perf_counter() - start)
        tokens = sum(len(g.output_ids) for g in out)
    return sorted(times)[len(times) // 2], tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    from megatron_rl.config import load_config
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.factory import make_standalone_engine
    from megatron_rl.rollout.hf_engine import HFEngine

    cfg = load_config(args.overrides, world_size=1)
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code)
    device = torch.device(args.device)
    weights = hub_state_dict(build_hf_model(cfg.model, seed=cfg.model.init_seed))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.model.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.n, seed=1)

    def hf(batch: int) -> HFEngine:
        return HFEngine(cfg.model, device=device, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, max_batch_size=batch)

    variants = {"hf, 1 sequence per call (baseline)": lambda: hf(1),
                f"hf, batches of {args.prompts * args.n}": lambda: hf(args.prompts * args.n)}
    if cfg.rollout.backend != "hf":
        work = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
        variants[f"{cfg.rollout.backend} ({' '.join(args.overrides)})"] = lambda: make_standalone_engine(
            cfg, tokenizer, device=device, index=0, work_dir=work)
    results = {}
    for name, build in variants.items():
        engine = build()
        try:
            engine.update_weights(iter(weights.items()), 1)
            seconds, tokens = _measure(engine, prompts, params, args.repeats)
        finally:
            if hasattr(engine, "shutdown"):
                engine.shutdown()
        results[name] = (seconds, tokens)
        print(f"  {name}: {seconds:.2f} s, {tokens} tokens", flush=True)
    print(f"{cfg.model.family} {cfg.model.num_layers} layers x {cfg.model.hidden_size}, {args.prompts} prompts x "
          f"{args.n} samples, {args.prompt_tokens} prompt tokens, up to {args.new_tokens} new tokens, "
          f"device {args.device}, median of {args.repeats}")
    base = next(iter(results.values()))
    base_tps = base[1] / base[0]
    for name, (seconds, tokens) in results.items():
        tps = tokens / seconds
        print(f"{name:56s} {seconds:8.2f} s {tps:10.0f} tokens/s  x{tps / base_tps:.2f}")


if __name__ == "__main__":
    main()
