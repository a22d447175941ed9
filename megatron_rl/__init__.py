"""megatron-rl: RL post-training on Megatron-core, time-shared with rollout engines, launched by Slurm.

Importing this package is cheap: heavy dependencies (megatron.core, sglang, grpc,
transformer_engine) are imported only inside the adapter modules that need them. It installs
an import hook that leaves out what megatron-core's import brings along unused
(`megatron_rl/parallel/megatron_import.py`; standard library only).
"""

from megatron_rl.parallel import megatron_import as _megatron_import

__version__ = "0.1.0"
_megatron_import.install()
