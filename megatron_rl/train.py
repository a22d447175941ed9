"""The main job: `python -m megatron_rl.train [overrides]` (or `sbatch slurm/run.sh [overrides]`).

`mode=rl` (the default): an optional supervised warm start, then per step
    rollout (colocated: offload trainer -> weight sync -> generate) -> rewards (async)
    -> advantages -> old log-probs -> policy update(s) -> eval / checkpoint / metrics
(megatron_rl/rl/). `mode=sft` runs the supervised entry point (`megatron_rl.sft`) instead.
"""

from __future__ import annotations

import sys
from typing import Sequence

from megatron_rl import runtime


def main(argv: Sequence[str] | None = None) -> None:
    # torch only in a rank (runtime.start returned one): a bad config and the local launcher never load it (~2 s).
    rt = runtime.start(list(sys.argv[1:] if argv is None else argv), "megatron_rl.train")
    if rt is None:
        return
    import torch

    torch.set_num_threads(torch.get_num_threads())
    try:
        if rt.cfg.mode == "sft":
            from megatron_rl.sft import run_sft

            run_sft(rt)
        else:
            from megatron_rl.rl.loop import run_rl

            run_rl(rt)
    finally:
        runtime.finish(rt)


if __name__ == "__main__":
    main()
