"""Fused log-prob kernel vs the naive log-softmax path: peak memory and time, same run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/logprob_kernel.py [--sizes 1024x32000x1024 2048x150000x64 ...]
        [--threads 1] [--device cpu|cuda] [--dtype float32|bfloat16] [--max-naive-gb 8]

For every size T x V x H (tokens x vocabulary x hidden), path (naive: full [T, V] logits,
`log_softmax`, gather, entropy; fused: `megatron_rl_kernels.fused_logprobs`) and mode
(forward; forward + backward of log-probs + entropy) a fresh subprocess builds the inputs,
then measures:
- peak memory: on CPU the resident-set high-water mark (VmHWM, reset through
  /proc/self/clear_refs once the inputs exist) minus the resident set at that point; on CUDA
  `torch.cuda.max_memory_allocated()` minus the memory allocated before the call;
- time: wall seconds of one call on CPU (the runs are seconds long); on CUDA the median of 5
  after 2 warm-up calls, with synchronisation.
Naive runs whose estimated peak (4.75 [T, V] fp32 buffers with backward, 3 without, measured
on CPU) exceeds --max-naive-gb are skipped and reported as such. Prints one table and the
fused / naive ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_SIZES = ["1024x32000x1024", "2048x150000x64", "8192x150000x64"]
NAIVE_BUFFERS = {"forward": 3.0, "forward+backward": 4.75}


def _child(path: str, mode: str, T: int, V: int, H: int, device: str, dtype: str, threads: int) -> dict:
    from megatron_rl_kernels import fused_logprobs, naive_logprobs

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen).to(device=device, dtype=dt).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.05).to(device=device, dtype=dt).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=gen).to(device)
    fn = fused_logprobs if path == "fused" else naive_logprobs
    backward = mode == "forward+backward"

    def call():
        with torch.set_grad_enabled(backward):
            lp, ent = fn(hidden, weight, targets, with_entropy=True)
            if backward:
                (lp.sum() + ent.sum()).backward()
                hidden.grad = weight.grad = None

    if device == "cuda":
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return dict(peak_bytes=torch.cuda.max_memory_allocated() - before, seconds=sorted(times)[2])
    base = reset_peak_rss()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    return dict(peak_bytes=peak_rss() - base, seconds=seconds)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def reset_peak_rss() -> int:
    """Reset the resident-set high-water mark to the current RSS (Linux: /proc/self/clear_refs
    "5") so earlier transient peaks (imports, input creation) do not hide smaller ones; returns
    the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS:") * 1024


def peak_rss() -> int:
    """Resident-set high-water mark (VmHWM) in bytes since the last reset."""
    return _status_kb("VmHWM:") * 1024


def _run_child(args: argparse.Namespace, path: str, mode: str, size: tuple[int, int, int]) -> dict:
    cmd = [sys.executable, __file__, "--child", path, mode, *map(str, size), "--device", args.device,
           "--dtype", args.dtype, "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="TxVxH")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-naive-gb", type=float, default=8.0)
    parser.add_argument("--child", nargs=5, metavar=("PATH", "MODE", "T", "V", "H"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, mode, T, V, H = args.child
        print(json.dumps(_child(path, mode, int(T), int(V), int(H), args.device, args.dtype, args.threads)))
        return

    print(f"device {args.device}, dtype {args.dtype}, threads {args.threads}, torch {torch.__version__}")
    header = f"{'T x V x H':>20} {'mode':>17} {'naive MB':>9} {'fused MB':>9} {'mem ratio':>9} " \
             f"{'naive s':>8} {'fused s':>8} {'time ratio':>10}"
    print(header)
    for spec in args.sizes:
        T, V, H = (int(x) for x in spec.split("x"))
        for mode in ("forward", "forward+backward"):
            fused = _run_child(args, "fused", mode, (T, V, H))
            estimate_gb = NAIVE_BUFFERS[mode] * T * V * 4 / 1e9
            naive = None if estimate_gb > args.max_naive_gb else _run_child(args, "naive", mode, (T, V, H))
            if naive is None:
                row = (f"{'skipped':>9} {fused['peak_bytes'] / 2**20:9.0f} {'-':>9} {'-':>8} {fused['seconds']:8.2f} "
                       f"{'-':>10}   (naive est. {estimate_gb:.1f} GB > --max-naive-gb)")
            else:
                row = (f"{naive['peak_bytes'] / 2**20:9.0f} {fused['peak_bytes'] / 2**20:9.0f} "
                       f"{fused['peak_bytes'] / naive['peak_bytes']:9.3f} {naive['seconds']:8.2f} "
                       f"{fused['seconds']:8.2f} {fused['seconds'] / naive['seconds']:10.2f}")
            print(f"{spec:>20} {mode:>17} {row}", flush=True)
            print("RESULT " + json.dumps({"size": spec, "mode": mode, "fused_mb": fused["peak_bytes"] / 2**20,
                                          "fused_s": fused["seconds"],
                                          "naive_mb": naive and naive["peak_bytes"] / 2**20,
                                          "naive_s": naive and naive["seconds"]}), flush=True)


if __name__ == "__main__":
    main()
