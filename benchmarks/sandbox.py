"""Sandbox service measurements, side by side with a plain subprocess in the same run.

    .venv/bin/python benchmarks/sandbox.py [--runtime bwrap] [--repeats 50] [--sessions 64]

Prints: median latency of `python3 -c pass` through gRPC against a plain local subprocess
(ratio; target <= 3x for bwrap), throughput at 1/8/64 concurrent callers, and how many
concurrent sessions the server held with every one answering an Exec.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.sandbox_servers import start_server  # noqa: E402

TRIVIAL = ["python3", "-c", "pass"]


def plain_latency(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "pass"], check=True)
        times.append(time.perf_counter() - start)
    return times


async def grpc_latency(client, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = await client.execute(TRIVIAL)
        assert result.exit_code == 0, result
        times.append(time.perf_counter() - start)
    return times


async def throughput(client, callers: int, total: int) -> tuple[float, int]:
    queue = list(range(total))
    errors = 0

    async def caller():
        nonlocal errors
        while queue:
            queue.pop()
            result = await client.execute(TRIVIAL)
            errors += result.exit_code != 0
    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return total / (time.perf_counter() - start), errors


async def sessions(client, count: int) -> tuple[int, int, float]:
    start = time.perf_counter()
    opened = await asyncio.gather(*(client.open_session({"id.txt": str(i)}) for i in range(count)),
                                  return_exceptions=True)
    live = [s for s in opened if not isinstance(s, Exception)]
    results = await asyncio.gather(*(s.exec(["cat", "id.txt"]) for s in live), return_exceptions=True)
    ok = sum(1 for i, r in enumerate(results) if not isinstance(r, Exception) and r.stdout == str(i).encode())
    await asyncio.gather(*(s.close() for s in live), return_exceptions=True)
    return len(live), ok, time.perf_counter() - start


async def main_async(args) -> None:
    from megatron_rl_sandbox.client import SandboxClient

    extra = ["--allow-unisolated"] if args.runtime == "process" else []
    server = start_server(args.runtime, "--capacity", str(args.capacity), "--max-sessions", str(args.sessions * 2),
                          *extra)
    try:
        async with SandboxClient([server.address], deadline_s=600) as client:
            await grpc_latency(client, 5)  # warm-up
            plain = plain_latency(args.repeats)
            via = await grpc_latency(client, args.repeats)
            p, g = statistics.median(plain), statistics.median(via)
            print(f"runtime: {args.runtime}; capacity {args.capacity}")
            print(f"latency python3 -c pass: plain subprocess {p * 1e3:.1f} ms | gRPC sandbox {g * 1e3:.1f} ms "
                  f"| ratio {g / p:.2f}x (target <= 3x)")
            for callers in (1, 8, 64):
                rate, errors = await throughput(client, callers, max(64, callers * 4))
                print(f"throughput {callers:>2} concurrent callers: {rate:6.1f} exec/s, {errors} errors")
            held, ok, seconds = await sessions(client, args.sessions)
            print(f"sessions: {held}/{args.sessions} opened, {ok} answered correctly ({seconds:.1f}s)")
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default="bwrap", choices=["bwrap", "apptainer", "process"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=2)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
