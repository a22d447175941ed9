"""The main job: `python -m megatron_rl.train [overrides]` (or `sbatch slurm/run.sh [overrides]`).

Until the RL loop lands this runs the supervised warm start (`mode=sft`) on the same
trainer; `mode=rl` is refused at validation, before anything starts.
"""

from __future__ import annotations

import sys
from typing import Sequence

from megatron_rl import runtime
from megatron_rl.sft import check_sft_config, run_sft


def check_train_config(cfg) -> None:
    from megatron_rl.config import ConfigError

    if cfg.mode == "rl":
        raise ConfigError("mode=rl is not available yet: the RL loop is not implemented in this version; "
                          "use mode=sft")
    check_sft_config(cfg)


def main(argv: Sequence[str] | None = None) -> None:
    rt = runtime.start(list(sys.argv[1:] if argv is None else argv), "megatron_rl.train",
                       check=check_train_config)
    if rt is None:
        return
    try:
        run_sft(rt)
    finally:
        runtime.finish(rt)


if __name__ == "__main__":
    main()
