"""Context parallelism on long sequences: per-rank peak memory and step time of
`Trainer.train_step` at CP=1 and CP=cp on the same batch and the same total cores, side by
side in the same run, as ratios.

    python benchmarks/context_parallel.py [--model tiny_qwen2] [--length 4096] [--samples 2]
        [--cp 2] [--cores 2] [--steps 3] [--repeats 3]

Same total cores: CP=1 is one rank with `--cores` threads, CP=cp is cp ranks with cores/cp
threads each. Each run is a fresh group of spawned gloo processes that takes a warm-up step
first; the two layouts alternate (cp=1, cp=cp, cp=cp, cp=1, ...) for `--repeats` rounds, so
that other work on a shared machine weighs on both, and the figures are medians over the rounds.

Time: the median of a run's `--steps` steps (the slowest rank's), and the fastest step of all runs
(other work on the machine only adds time, so the fastest step is the nearest to a quiet machine).

Memory, in runs of their own: the growth of each rank's peak resident set during one step over
its resident set before it, the largest rank's. That is what a step adds (activations kept for
the backward pass, attention, transient gradients) on top of the model, gradient buffers and
optimizer state. glibc's malloc would keep memory freed by earlier steps and reuse it unseen,
so these runs give it a fixed mmap threshold (`MALLOC_MMAP_THRESHOLD_`: blocks of 128 KiB and
more come from the system and go back to it when freed), which costs time (hence separate runs);
the peak is reset through /proc/self/clear_refs before the step. Linux with glibc only; on GPU
use torch.cuda's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MMAP_THRESHOLD = 128 * 1024  # glibc's default starting threshold, kept fixed in the memory runs


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, measure: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.cores // world)
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
    if measure == "time":
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            trainer.train_step(samples)
            times.append(time.perf_counter() - start)
        result = {"time": statistics.median(times), "best": min(times)}
    else:
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        trainer.train_step(samples)
        result = {"growth": max(_status_kib("VmHWM") - before, 0) * 1024, "resident": before * 1024}
    torch.save(result, f"{out}.{rank}")


def _run(world: int, args: argparse.Namespace, measure: str) -> dict:
    """One run of a layout: {"time": median step seconds, "best": fastest step} of its slowest rank, or
    {"growth", "resident"} in bytes of its largest rank."""
    import torch.multiprocessing as mp

    from megatron_rl.parallel.dist import free_port

    env = os.environ.copy()
    if measure == "memory":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # read by the spawned ranks' malloc
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r")
            mp.start_processes(_worker, args=(world, free_port(), args, measure, out), nprocs=world,
                               start_method="spawn")
            parts = [torch.load(f"{out}.{r}") for r in range(world)]
    finally:
        os.environ.clear()
        os.environ.update(env)
    return {key: max(p[key] for p in parts) for key in parts[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny_qwen2")
    p.add_argument("--length", type=int, default=4096, help="tokens per sample (one sample per packed row)")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--cores", type=int, default=2, help="threads of each layout in all (cp=1: one rank)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=3, help="rounds of runs of each layout, alternating")
    args = p.parse_args()
    if args.cores % args.cp:
        raise ValueError(f"--cores={args.cores} does not split over --cp={args.cp} ranks: use a multiple of {args.cp}")
    runs: dict[int, list[dict]] = {1: [], args.cp: []}
    loads = []  # the machine's 1-minute load average before each timed run: how much other work shared it
    for repeat in range(args.repeats):
        for world in (1, args.cp) if repeat % 2 == 0 else (args.cp, 1):
            loads.append(os.getloadavg()[0])
            runs[world].append({**_run(world, args, "time"), **_run(world, args, "memory")})

    def median(world: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[world])

    def best(world: int) -> float:
        return min(r["best"] for r in runs[world])

    print(f"{args.model}: {args.samples} x {args.length} tokens per step, fp32, CPU, {args.cores} threads per "
          f"layout; medians of {args.repeats} runs ({args.steps} timed steps each, one memory step); load average "
          f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
    for world in (1, args.cp):
        times = ", ".join(f"{r['time']:.2f}" for r in runs[world])
        growths = ", ".join(f"{r['growth'] / 2**20:.0f}" for r in runs[world])
        print(f"{f'cp={world} ({world} x {args.cores // world} threads)':24s} {median(world, 'time'):6.2f} s/step "
              f"[{times}], fastest {best(world):.2f}  peak growth per rank {median(world, 'growth') / 2**20:6.0f} MiB "
              f"[{growths}]  (resident before {median(world, 'resident') / 2**20:.0f} MiB)")
    print(f"ratio cp={args.cp} / cp=1: step time x{median(args.cp, 'time') / median(1, 'time'):.2f} "
          f"(fastest steps x{best(args.cp) / best(1):.2f}), "
          f"per-rank peak growth x{median(args.cp, 'growth') / median(1, 'growth'):.2f}")
    print("RESULT " + json.dumps({"length": args.length, "cp": args.cp, "time_ratio": median(args.cp, "time") /
                                  median(1, "time"), "fastest_time_ratio": best(args.cp) / best(1),
                                  "memory_ratio": median(args.cp, "growth") / median(1, "growth")}))

if __name__ == "__main__":
    main()
