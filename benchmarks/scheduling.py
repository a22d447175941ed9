"""Rollout scheduling: concurrent episodes with a batching engine against the best a user gets without the
scheduler, all episodes of a step in one synchronous batch (lockstep: every turn one `generate` call over all
live episodes, then all their tool calls), in the same run, on a synthetic environment whose tool calls take
U(0.1, 2.0) s.

    python benchmarks/scheduling.py [--episodes 32] [--turns 3] [--oversample 0] [--max-batch 256]

The scheduler's settings default to the product's (rollout.max_batch_size, rollout.oversample), so that the
figure is what a user gets; smaller batches or an early cut are options.

Both arms drive the same hf engine (a small Qwen2-style model with random weights, sized
with --hidden/--layers so that generating a turn costs about as much as a tool call, as
with a real model on real hardware) and the same environment. Printed: wall time per
rollout step, engine-busy fraction (time inside `generate` / wall time), and the ratios. The
lockstep batch waits, every turn, for its slowest tool call and its longest generation; the
scheduler overlaps one episode's tool call with the others' generation.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time


def main() -> None:
    import torch

    from megatron_rl.config import load_config
    from megatron_rl.config.rollout import RolloutConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.envs import make_environment
    from megatron_rl.models.hf import build_hf_model
    from megatron_rl.observability.timeline import Timeline
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.hf_engine import HFEngine
    from megatron_rl.rollout.multiturn import EpisodeLimits, TurnFormat, run_episodes
    from megatron_rl.rollout.scheduler import run_episodes_async

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    defaults = RolloutConfig()
    p.add_argument("--max-batch", type=int, default=defaults.max_batch_size,
                   help="scheduler: most rows per engine call (default: rollout.max_batch_size's)")
    p.add_argument("--oversample", type=float, default=defaults.oversample, help="scheduler: start this many more "
                   "episodes and cut the stragglers once --episodes have finished (rollout.oversample; default: its "
                   "default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trace", default=None, help="write the scheduler's Chrome trace here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer("builtin:char")
    model_cfg = load_config(["model=tiny_qwen2", f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                             f"model.ffn_hidden_size={args.hidden * 3}"], world_size=1).model
    engine = HFEngine(model_cfg, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    engine.update_weights(list(build_hf_model(model_cfg, seed=1).state_dict().items()), version=1)
    fmt = TurnFormat(tokenizer, "Use tools.")
    tasks = [{"id": f"t{i}", "instruction": f"Task {i}: find the value.", "answer": "7"} for i in range(args.episodes)]
    limits = EpisodeLimits(max_turns=args.turns + 1, max_tokens=480, wall_time_s=600)
    # The model never emits the end-of-turn token reliably (random weights): turns are cut at
    # --new-tokens, so every turn costs the same, in both arms.
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0)

    def make_env():
        return make_environment("synthetic", turns=args.turns)

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    class Timed:  # the engine with its time inside generate recorded
        busy = 0.0

        def generate(self, prompts, sampling):
            start = time.perf_counter()
            try:
                return engine.generate(prompts, sampling)
            finally:
                Timed.busy += time.perf_counter() - start

    start = time.perf_counter()
    lockstep = run_episodes(Timed(), tasks, 1, params, make_env, fmt, limits, loop)  # one batch, every turn
    seq_wall, seq_busy = time.perf_counter() - start, Timed.busy
    assert all(e.num_turns == args.turns for e in lockstep)

    timeline = Timeline()
    extra = [{"id": f"x{i}", "instruction": f"Task x{i}: find the value.", "answer": "7"}
             for i in range(round(args.episodes * args.oversample))]
    episodes, stats = run_episodes_async(engine, tasks + extra, 1, params, make_env, fmt, limits, loop,
                                         max_concurrency=len(tasks) + len(extra), max_batch=args.max_batch,
                                         target_groups=args.episodes, timeline=timeline)
    finished = [e for e in episodes if e.status == "submitted"]
    assert len(finished) >= args.episodes and all(e.num_turns == args.turns for e in finished)
    if args.trace:
        from pathlib import Path

        timeline.to_chrome_trace(Path(args.trace))
    busy = stats["sched/engine_busy"]
    print(f"{args.episodes} episodes x {args.turns} turns, tool latency U(0.1, 2.0) s, model hidden {args.hidden} x "
          f"{args.layers} layers, {args.new_tokens} tokens/turn, {args.threads} threads")
    print(f"lockstep batch  : {seq_wall:7.1f} s per step, engine busy {seq_busy / seq_wall:6.1%} (all "
          f"{args.episodes} episodes in each turn's one generate call)")
    print(f"scheduler       : {stats['sched/wall_s']:7.1f} s per step, engine busy {busy:6.1%} "
          f"(batch <= {args.max_batch}; {len(extra)} extra episodes started, {int(stats['sched/aborted'])} cut)")
    print(f"ratio           : step time x{seq_wall / stats['sched/wall_s']:.2f} shorter than lockstep, engine busy "
          f"x{busy / (seq_busy / seq_wall):.2f}")
    loop.call_soon_threadsafe(loop.stop)


if __name__ == "__main__":
    main()
