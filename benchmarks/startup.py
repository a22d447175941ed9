"""Process start-up: seconds to import what a training rank imports (torch, megatron-core's model,
optimizer, schedules and DDP modules, transformers' model classes), in fresh interpreters, with
megatron-rl's import hook (`megatron_rl/parallel/megatron_import.py`, installed by
`import megatron_rl`) and without it (megatron-core imported first), alternating, side by side.

    python benchmarks/startup.py [--repeats 5]

Every rank of every job pays this, and the test suite starts hundreds of such processes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

IMPORTS = ("import torch, megatron.core.models.gpt, megatron.core.optimizer, megatron.core.distributed, "
           "megatron.core.pipeline_parallel, megatron.core.timers, transformers, "
           "transformers.models.qwen2.modeling_qwen2")
VARIANTS = {"without the hook": "", "with the hook": "import megatron_rl; "}
PROBE = "import time; start = time.perf_counter(); {first}{imports}; print(time.perf_counter() - start)"


def _once(first: str) -> float:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE.format(first=first, imports=IMPORTS)],
                          capture_output=True, text=True, check=True)
    return float(proc.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    _once("")  # warm the page cache and bytecode
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, first in VARIANTS.items():
            times[name].append(_once(first))
    base = statistics.median(times["without the hook"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:18s} median {median:5.2f} s  (min {min(values):5.2f}, max {max(values):5.2f})  "
              f"ratio {median / base:4.2f}")


if __name__ == "__main__":
    main()
