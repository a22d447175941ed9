"""Rollout throughput: generated tokens/s of the RL loop's generation against one batched `transformers`
`generate` call over the same rows, weights, dtype and sampling, side by side in one run.

    python benchmarks/rollout.py [--steps 4] [--repeats 3] [overrides ...]
    python benchmarks/rollout.py model=smollm2_135m model.path=$(bash launch/get_model.sh smollm2-135m) \
        task=arithmetic task.chat_template=true global_batch_size=16 rollout.n_samples_per_prompt=4 \
        rollout.max_new_tokens=64

`overrides` are the main job's Hydra overrides. Arms, all on this process's threads (`OMP_NUM_THREADS`, or
every core):

- baseline: `transformers` `generate(do_sample=True)` called once on all of a step's rows (each prompt
  `rollout.n_samples_per_prompt` times, left-padded), as a user would batch it, with the run's temperature,
  top-k, top-p, response limit and stop tokens (end-of-sequence and the chat template's end of turn);
- the rollout engine alone (the hf engine, or the configured backend, e.g. SGLang from its test venv), one
  call on the same rows;
- in the loop: `python -m megatron_rl.train mode=rl` for `--steps` steps, read from its own metrics
  (`rollout/tokens_per_s`: the step's generated tokens over rank 0's generation time, weight sync and
  rewards excluded; the loop runs on one rank), the median over steps 2.. (step 1 warms up).

The first two arms generate for the prompts of the loop's step 1, read back from its dumped rollouts, so
every arm sees the same rows. Tokens count up to and including the stop token; each arm's median over
`--repeats` calls after one warm-up call. Weights: `model.path`'s, or for a model built from its config, the
seeded initialisation the run uses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _loop(overrides: list[str], steps: int, run_dir: Path) -> tuple[list[float], list[list[int]]]:
    """(rollout/tokens_per_s of steps 2.., step 1's prompts as token ids, one per group)."""
    args = [sys.executable, "-m", "megatron_rl.train", "mode=rl", *overrides, f"run_dir={run_dir}",
            f"num_steps={steps}", "task.num_eval=0", "logging.dump_rollouts=true", "logging.progress=false",
            "logging.tensorboard=false", "checkpoint.save_every=0"]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads())))
    if proc.returncode != 0:
        raise SystemExit(f"the RL run failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["rollout/tokens_per_s"] for r in rows if r.get("step", 0) >= 2 and "rollout/tokens_per_s" in r]
    dumped = [json.loads(line) for line in (run_dir / "rollouts" / "step_00000001.jsonl").read_text().splitlines()]
    prompts: dict[int, list[int]] = {}
    for r in dumped:
        prompts.setdefault(r["prompt_index"], r["prompt_tokens"])
    return speeds, list(prompts.values())


def _count(new: torch.Tensor, stop: set[int]) -> int:
    """Tokens generated: each row up to and including its first stop token."""
    total = 0
    for row in new.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        total += end
    return total


def _timed(call, repeats: int) -> tuple[float, int]:
    """(median tokens/s, tokens of the median call) of `call() -> tokens`, after one warm-up call."""
    call()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = call()
        runs.append((tokens / (time.perf_counter() - start), tokens))
    return sorted(runs)[len(runs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="RL steps of the in-loop arm (>= 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2: step 1 warms up")

    from transformers import AutoModelForCausalLM

    from megatron_rl.config import load_config
    from megatron_rl.data.tasks import Task
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.gpt import torch_dtype
    from megatron_rl.models.hf import build_hf_model, hub_state_dict
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.factory import make_standalone_engine

    cfg = load_config(args.overrides, world_size=1)
    r = cfg.rollout
    tokenizer = load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code)
    stop = {tokenizer.eos_token_id, *Task(cfg.task, tokenizer).stop_token_ids}
    n, dtype = r.n_samples_per_prompt, torch_dtype(cfg.model.dtype)
    device = torch.device("cuda" if cfg.cluster.device == "cuda" or (cfg.cluster.device == "auto" and
                                                                      torch.cuda.is_available()) else "cpu")

    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        speeds, prompts = _loop(args.overrides, args.steps, Path(tmp) / "run")
        rows = [p for p in prompts for _ in range(n)]
        if cfg.model.path:
            model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype).to(device).eval()
        else:
            model = build_hf_model(cfg.model, seed=cfg.model.init_seed).to(device, dtype).eval()
        width = max(map(len, rows))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], device=device)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
        sampling = (dict(do_sample=False) if r.temperature == 0 else
                    dict(do_sample=True, temperature=r.temperature, top_p=r.top_p, top_k=max(r.top_k, 0)))

        @torch.no_grad()
        def plain() -> int:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=r.max_new_tokens, eos_token_id=sorted(stop),
                                 pad_token_id=pad, **sampling)
            return _count(out[:, width:], stop)

        baseline = _timed(plain, args.repeats)
        engine = make_standalone_engine(cfg, tokenizer, device=device, index=0, work_dir=Path(tmp))
        try:
            engine.update_weights(iter(hub_state_dict(model).items()), 1)
            params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                    max_new_tokens=r.max_new_tokens, stop_token_ids=tuple(sorted(stop)), n=n, seed=1)
            alone = _timed(lambda: sum(len(g.output_ids) for g in engine.generate(prompts, params)), args.repeats)
        finally:
            if hasattr(engine, "shutdown"):
                engine.shutdown()

    print(f"{cfg.model.family} {cfg.model.num_layers} layers x {cfg.model.hidden_size}, {cfg.model.dtype} on {device}, "
          f"{len(prompts)} prompts x {n} samples ({min(map(len, prompts))}-{width} prompt tokens), up to "
          f"{r.max_new_tokens} new tokens, temperature {r.temperature}, {torch.get_num_threads()} threads; "
          f"median of {args.repeats} calls, the loop over steps 2-{args.steps}")
    loop = statistics.median(speeds)
    for name, (tps, tokens) in [("transformers generate, one batched call (baseline)", baseline),
                                (f"{r.backend} engine alone, one call", alone),
                                ("in the RL loop (rollout/tokens_per_s)", (loop, None))]:
        shown = f"{tokens} tokens" if tokens is not None else f"steps {', '.join(f'{s:.0f}' for s in speeds)}"
        print(f"  {name:52s} {tps:8.1f} tokens/s  x{tps / baseline[0]:.2f}   ({shown})")
    print("RESULT " + json.dumps({"generate_tokens_per_s": baseline[0], "engine_tokens_per_s": alone[0],
                                  "engine_vs_generate": alone[0] / baseline[0], "loop_tokens_per_s": loop,
                                  "backend": r.backend, "dtype": cfg.model.dtype}))


if __name__ == "__main__":
    main()
