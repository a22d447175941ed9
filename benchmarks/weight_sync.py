"""Weight sync throughput: Megatron -> HF layout -> hf rollout engine, against a plain copy of
the same bytes in the same run.

    .venv/bin/python benchmarks/weight_sync.py [--model qwen2_5_0_5b] [--bucket-mb 256] [--repeats 3]

The model is built from the architecture in conf/model/<model>.yaml with random weights
(Megatron's own initialisation; nothing is downloaded). Prints sync seconds and GB/s, the
plain-copy GB/s (every engine tensor `copy_`-ed from a same-shaped source), and their ratio
(target >= 0.5 on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_5_0_5b")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.models.gpt import build_model
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.weight_sync.stream import sync_weights

    # the architecture of conf/model/<model>.yaml with random weights; float32: the CPU path trains
    # in fp32, so engine and trainer agree
    try:
        model_cfg = load_config([f"model={args.model}", "model.path=null", "model.tokenizer=builtin:char",
                                 "model.dtype=float32"], world_size=1).model
    except ConfigError as exc:
        parser.error(str(exc))
    mdist.init_distributed(mdist.dist_env_from({}), torch.device("cpu"))
    groups = state.initialize(1, 1)
    start = time.perf_counter()
    model = build_model(model_cfg, groups)
    engine = HFEngine(model_cfg)
    params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {params / 1e9:.3f} B parameters (built in {time.perf_counter() - start:.0f}s), "
          f"threads {torch.get_num_threads()}")

    targets = [t for t in engine.model.state_dict().values()]
    sources = [torch.empty_like(t).normal_() for t in targets]
    nbytes = sum(t.numel() * t.element_size() for t in targets)
    copy_times, sync_times, sync_bytes = [], [], 0
    for i in range(args.repeats):
        t0 = time.perf_counter()
        for dst, src in zip(targets, sources):
            dst.copy_(src)
        copy_times.append(time.perf_counter() - t0)
        stats = sync_weights(model, groups, model_cfg, engine, version=i + 1, bucket_bytes=args.bucket_mb * 2**20)
        sync_times.append(stats.seconds)
        sync_bytes = stats.num_bytes
    copy_gbs = nbytes / statistics.median(copy_times) / 1e9
    sync_gbs = sync_bytes / statistics.median(sync_times) / 1e9
    print(f"plain copy : {nbytes / 1e9:.2f} GB in {statistics.median(copy_times):.3f}s = {copy_gbs:.2f} GB/s")
    print(f"weight sync: {sync_bytes / 1e9:.2f} GB in {statistics.median(sync_times):.3f}s = {sync_gbs:.2f} GB/s "
          f"({args.bucket_mb} MB buckets)")
    print(f"ratio sync / plain copy: {sync_gbs / copy_gbs:.2f} (target >= 0.5)")


if __name__ == "__main__":
    main()
