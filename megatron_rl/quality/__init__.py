"""Environment quality inspection (`python -m megatron_rl.quality`): solvability, verifier flip rates,
known-bad candidates, duplicates, contamination, descriptions and difficulty. The environment pool
maintained during training is `data/env_pool.py`; the reward audit is `rewards/audit.py`."""
