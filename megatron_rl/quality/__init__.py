"""Environment quality inspection (`python -m megatron_rl.quality`), the environment pool
maintained during training (`env_pool`) and the reward audit (`audit`)."""
