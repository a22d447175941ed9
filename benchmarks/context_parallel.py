"""Context parallelism on long sequences: per-rank peak memory and step time of
`Trainer.train_step` at CP=1 (one rank) and CP=cp (cp ranks) on the same batch, side by
side in the same run, as ratios.

    python benchmarks/context_parallel.py [--model tiny_qwen2] [--length 4096] [--samples 2]
        [--cp 2] [--steps 3]

Each run is a fresh group of spawned gloo processes (one thread each). Memory is the growth
of each rank's peak resident set during the measured steps over its resident set before
them (activations, attention scores, gradients; CPU only: on GPU use torch.cuda's counters).
On this path attention materialises its scores, [heads, S/cp, S] per layer and rank, so the
per-rank figure should fall towards 1/cp as the sequence grows; the step time of cp ranks
that share a machine's cores is no measure of the speed-up on separate GPUs.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron_rl.config import load_config
    from megatron_rl.config.schema import OptimizerConfig
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.trainer.core import Trainer, TrainerOptions
    from megatron_rl.trainer.packing import Sample

    model_cfg = load_config([f"model={args.model}", "model.dtype=float32",
                             f"model.max_position_embeddings={max(args.length, 2048)}"], world_size=1).model
    mdist.init_distributed(mdist.dist_env_from(), torch.device("cpu"), timeout_s=600)
    groups = state.initialize(1, 1, world)
    gen = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, model_cfg.vocab_size, (args.length,), generator=gen),
                      torch.ones(args.length - 1)) for _ in range(args.samples)]
    trainer = Trainer(model_cfg, OptimizerConfig(lr=1e-5), groups, TrainerOptions(micro_batch_tokens=args.length))
    trainer.initialize_weights()
    trainer.train_step(samples)  # warm-up: optimizer state exists from here on
    before = _rss_bytes()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        trainer.train_step(samples)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.save({"time": statistics.median(times), "growth": max(peak - before, 0)}, f"{out}.{rank}")


def _run(world: int, args: argparse.Namespace) -> tuple[float, float]:
    """(median step time, largest per-rank peak memory growth in bytes) of one layout."""
    import torch.multiprocessing as mp

    from megatron_rl.parallel.dist import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        mp.start_processes(_worker, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
        parts = [torch.load(f"{out}.{r}") for r in range(world)]
    return max(p["time"] for p in parts), max(p["growth"] for p in parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny_qwen2")
    p.add_argument("--length", type=int, default=4096, help="tokens per sample (one sample per packed row)")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    base_time, base_mem = _run(1, args)
    cp_time, cp_mem = _run(args.cp, args)
    print(f"{args.model}: {args.samples} x {args.length} tokens per step, median of {args.steps} steps, fp32, CPU")
    print(f"{'cp=1 (1 rank)':18s} {base_time:8.2f} s/step  peak memory growth per rank {base_mem / 2**20:8.0f} MiB")
    print(f"{f'cp={args.cp} ({args.cp} ranks)':18s} {cp_time:8.2f} s/step  peak memory growth per rank "
          f"{cp_mem / 2**20:8.0f} MiB")
    print(f"ratio cp={args.cp} / cp=1: step time x{cp_time / base_time:.2f}, per-rank memory x{cp_mem / base_mem:.2f}")


if __name__ == "__main__":
    main()
