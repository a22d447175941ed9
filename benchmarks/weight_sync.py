"""Weight sync throughput: Megatron -> HF layout -> hf rollout engine, against a plain copy of
the same bytes in the same run.

    .venv/bin/python benchmarks/weight_sync.py [--model qwen2_5_0_5b] [--bucket-mb 256] [--repeats 5]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--transformer-impl auto|local] [--stream]

The model is built from the architecture in conf/model/<model>.yaml with random weights
(Megatron's own initialisation; nothing is downloaded). One sync first makes the in-place plan
(timed apart); then, alternating in each repeat, the plain copy (every engine tensor `copy_`-ed
from a preallocated source of the same shape, dtype and device: the same bytes, in one Python
loop) and a sync. Prints both arms per repeat side by side, their medians and fastest, the median
of the repeats' own ratios (steadier on a shared machine: a repeat's two arms share its load), and
the ratio of the sync's GB/s to the copy's (targets: >= 0.9 on CPU, >= 0.8 on GPU). `--stream`
syncs through the bucketed stream by name instead, as an engine in another process is synced.

    .venv/bin/python benchmarks/weight_sync.py --lora-rank 16

With `--lora-rank r` the model carries LoRA adapters on every targeted linear (B random, so they change the
model) and the benchmark puts the two ways of syncing such a model side by side in the same run: the merged
weights every step (rollout.weight_sync=full) against the adapters alone (rollout.weight_sync=adapters, on an
engine that holds the base), seconds and bytes of each and their ratios.

    .venv/bin/python benchmarks/weight_sync.py --model smollm2_135m --delta lora --bucket-mb 4

With `--delta lora|frozen` the weights go to a generator as in disaggregated mode (a `BroadcastSink` and a
`WeightReceiver` over a gloo weight group of two, the generator a thread of this process loading an hf engine),
each bucket checksummed and acknowledged, and between publishes only part of the model moves: `lora` merged LoRA
adapters on linear_qkv (rank `--lora-rank`, 8 by default; weight_sync=full), `frozen` the last quarter of the
layers (the others frozen). Alternating, a full publish and a delta publish (rollout.weight_sync_delta), each after
one such move: bytes broadcast against a full sync's, seconds, and the trainer's hashing time, side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2_5_0_5b")
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lora-rank", type=int, default=0, help="compare merged and adapter-only syncs")
    parser.add_argument("--delta", choices=["lora", "frozen"], default=None,
                        help="disaggregated publish, full against delta, with LoRA on linear_qkv or frozen layers")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="trainer's and engine's device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--stream", action="store_true",
                        help="sync through the bucketed stream by name (the path of engines in other processes)")
    parser.add_argument("--transformer-impl", default="auto", choices=["auto", "transformer_engine", "local"],
                        help="model.transformer_impl (local: Megatron's local spec, also on a GPU without TE)")
    args = parser.parse_args()

    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.models.gpt import build_model
    from megatron_rl.parallel import dist as mdist
    from megatron_rl.parallel import state
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.weight_sync.stream import sync_weights

    # the architecture of conf/model/<model>.yaml with random weights; engine and trainer in one dtype (the
    # CPU path trains in fp32), so weight sync copies without converting
    try:
        lora = ["model.lora_rank=" + str(args.lora_rank or 8), "model.lora_targets=[linear_qkv]"] \
            if args.delta == "lora" else [f"model.lora_rank={args.lora_rank}"]
        model_cfg = load_config([f"model={args.model}", "model.path=null", "model.tokenizer=builtin:char",
                                 f"model.dtype={args.dtype}", *lora,
                                 f"model.transformer_impl={args.transformer_impl}"], world_size=1).model
    except ConfigError as exc:
        parser.error(str(exc))
    device = torch.device(args.device)
    mdist.init_distributed(mdist.dist_env_from({}), device)
    groups = state.initialize(1, 1, device=device)
    start = time.perf_counter()
    model = build_model(model_cfg, groups)
    engine = HFEngine(model_cfg, device=device)
    params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {params / 1e9:.3f} B parameters (built in {time.perf_counter() - start:.0f}s), "
          f"threads {torch.get_num_threads()}")

    if args.delta:
        return compare_delta(model, groups, model_cfg, engine, args)
    if args.lora_rank:
        return compare_lora(model, groups, model_cfg, engine, args)
    # each engine tensor once (a tied lm_head is the embedding's storage, which weight sync sends once)
    targets = list({t.data_ptr(): t for t in engine.model.state_dict().values()}.values())
    sources = [torch.empty_like(t).normal_() for t in targets]
    nbytes = sum(t.numel() * t.element_size() for t in targets)
    bucket = int(args.bucket_mb * 2**20)
    receiver = _ByName(engine) if args.stream else engine
    first = sync_weights(model, groups, model_cfg, receiver, version=1, bucket_bytes=bucket)
    print(f"first sync{' (makes the in-place plan)' if first.num_buckets == 0 else ''}: {first.seconds:.3f}s")
    if first.num_bytes != nbytes:
        raise SystemExit(f"the sync moves {first.num_bytes} bytes, the engine holds {nbytes}: the arms differ")
    print(f"{'repeat':>6}  {'plain copy s':>12}  {'weight sync s':>13}  {'ratio':>5}")
    copy_times, sync_times = [], []
    for i in range(args.repeats):
        _synchronize(device)
        t0 = time.perf_counter()
        for dst, src in zip(targets, sources):
            dst.copy_(src)
        _synchronize(device)
        copy_times.append(time.perf_counter() - t0)
        stats = sync_weights(model, groups, model_cfg, receiver, version=i + 2, bucket_bytes=bucket)
        sync_times.append(stats.seconds)
        print(f"{i + 1:>6}  {copy_times[-1]:>12.4f}  {sync_times[-1]:>13.4f}  {copy_times[-1] / sync_times[-1]:>5.2f}")
    copy_s, sync_s = statistics.median(copy_times), statistics.median(sync_times)
    path = "in place" if stats.num_buckets == 0 else f"{stats.num_buckets} buckets of {args.bucket_mb} MB"
    print(f"plain copy : {nbytes / 1e9:.2f} GB in {copy_s:.4f}s = {nbytes / copy_s / 1e9:.2f} GB/s "
          f"({len(targets)} tensors, median of {args.repeats})")
    print(f"weight sync: {stats.num_bytes / 1e9:.2f} GB in {sync_s:.4f}s = {stats.num_bytes / sync_s / 1e9:.2f} GB/s "
          f"({stats.num_tensors} tensors, {path}, median of {args.repeats})")
    print(f"fastest of {args.repeats}: plain copy {min(copy_times):.4f}s, weight sync {min(sync_times):.4f}s, "
          f"ratio {min(copy_times) / min(sync_times):.2f}")
    # each repeat's two arms run back to back, under the same load from other processes
    print(f"median of the {args.repeats} repeats' ratios: "
          f"{statistics.median(c / s for c, s in zip(copy_times, sync_times)):.2f}")
    target = 0.9 if device.type == "cpu" else 0.8
    print(f"ratio sync / plain copy (medians): {copy_s / sync_s:.2f} (target >= {target} on {device.type})")
    print("RESULT " + json.dumps({"path": path, "bytes": stats.num_bytes, "copy_s": copy_s, "sync_s": sync_s,
                                  "ratio": copy_s / sync_s, "ratio_median_of_repeats": statistics.median(
                                      c / s for c, s in zip(copy_times, sync_times)), "device": device.type}))


class _ByName:
    """The engine through `update_weights` alone, as weight sync reaches an engine in another process."""

    def __init__(self, engine) -> None:
        self.update_weights = engine.update_weights


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compare_lora(model, groups, model_cfg, engine, args) -> None:
    """Merged weights every step against the adapters alone, alternating, medians of each."""
    from megatron_rl.models.lora import attach_lora
    from megatron_rl.weight_sync.stream import sync_adapters, sync_weights

    adapters = attach_lora(model, model_cfg, groups)
    with torch.no_grad():
        for adapter in adapters:
            adapter.b.normal_(0, 0.01)
    bucket = int(args.bucket_mb * 2**20)
    sync_weights(model, groups, model_cfg, engine, 1, bucket, merged=False)  # the base, once
    full, alone = [], []
    for i in range(args.repeats):
        full.append(sync_weights(model, groups, model_cfg, engine, 2 * i + 2, bucket))
        alone.append(sync_adapters(model, groups, model_cfg, engine, 2 * i + 3))
    full_s, alone_s = (statistics.median(s.seconds for s in runs) for runs in (full, alone))
    full_b, alone_b = full[-1].num_bytes, alone[-1].num_bytes
    print(f"LoRA r={args.lora_rank} on {len(adapters)} linears ({sum(a.a.numel() + a.b.numel() for a in adapters) / 1e6:.2f} M "
          f"adapter numbers)")
    print(f"merged weights (weight_sync=full)    : {full_b / 1e6:9.1f} MB in {full_s:.3f}s")
    print(f"adapters alone (weight_sync=adapters): {alone_b / 1e6:9.1f} MB in {alone_s:.3f}s")
    print(f"ratio full / adapters: bytes x{full_b / alone_b:.1f}, time x{full_s / alone_s:.1f}")


def compare_delta(model, groups, model_cfg, engine, args) -> None:
    """A full publish and a delta publish to a generator (a thread with its own end of a gloo weight group),
    alternating, each after a step's worth of change."""
    import threading

    from megatron_rl.disagg.weights import BroadcastSink, WeightReceiver
    from megatron_rl.models.lora import attach_lora
    from megatron_rl.parallel.dist import WeightUpdateGroup, free_port, weight_update_store
    from megatron_rl.weight_sync.stream import sync_weights

    key, port, device = b"b" * 32, free_port(), torch.device(args.device)
    adapters = attach_lora(model, model_cfg, groups) if args.delta == "lora" else []
    last = [p for n, p in model.named_parameters()
            if ".layers." in n and int(n.split(".layers.")[1].split(".")[0]) >= model_cfg.num_layers * 3 // 4]
    gen = torch.Generator(device=device).manual_seed(0)

    def move() -> None:  # one step's worth: the adapters' B, or the unfrozen last quarter of the layers
        with torch.no_grad():
            for p in [a.b for a in adapters] or last:
                p.add_(1e-3 * torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype))

    store = weight_update_store("127.0.0.1", port, 2, is_master=True, timeout_s=600)
    stop = threading.Event()

    def generator() -> None:
        peer = weight_update_store("127.0.0.1", port, 2, is_master=False, timeout_s=600)
        receiver = WeightReceiver(WeightUpdateGroup(peer, 1, 2, device, 600), peer, engine, key)
        while not stop.is_set():
            if not receiver.poll():
                time.sleep(0.001)

    thread = threading.Thread(target=generator, daemon=True)
    thread.start()
    sink = BroadcastSink(WeightUpdateGroup(store, 0, 2, device, 600), store, key)
    bucket = int(args.bucket_mb * 2**20)
    version = 0
    sync_weights(model, groups, model_cfg, sink, version, bucket)  # the generator's first weights: everything
    arms: dict[bool, list] = {False: [], True: []}
    for _ in range(args.repeats):
        for delta in (False, True):
            move()
            sink.delta, version = delta, version + 1
            stats = sync_weights(model, groups, model_cfg, sink, version, bucket)
            arms[delta].append((stats.seconds, sink.last_counts))
    stop.set()
    thread.join(timeout=60)
    print(f"{args.model}, {args.delta}: {sink.last_counts.buckets} buckets of {args.bucket_mb} MB, "
          f"median of {args.repeats}")
    out = {}
    for delta, runs in arms.items():
        seconds = statistics.median(s for s, _ in runs)
        sent = statistics.median(c.bytes_sent for _, c in runs)
        full = runs[-1][1].bytes_full
        hashing = statistics.median(c.hash_seconds for _, c in runs)
        name = "delta" if delta else "full"
        print(f"{name:>5}: sent {sent / 1e6:9.1f} of {full / 1e6:9.1f} MB ({sent / full:6.1%}) in {seconds:.3f}s, "
              f"trainer's hashing {hashing:.3f}s")
        out[name] = {"bytes_sent": sent, "bytes_full": full, "seconds": seconds, "hash_seconds": hashing}
    print(f"delta / full: bytes {out['delta']['bytes_sent'] / out['full']['bytes_sent']:.3f}, "
          f"time {out['delta']['seconds'] / out['full']['seconds']:.3f}")
    print("RESULT " + json.dumps({"delta": args.delta, "bucket_mb": args.bucket_mb, **out,
                                  "device": device.type}))


if __name__ == "__main__":
    main()
