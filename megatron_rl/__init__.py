"""megatron-rl: RL post-training on Megatron-core, time-shared with rollout engines, launched by Slurm.

Importing this package is cheap: heavy dependencies (megatron.core, sglang, grpc,
transformer_engine) are imported only inside the adapter modules that need them.
"""

__version__ = "0.1.0"
