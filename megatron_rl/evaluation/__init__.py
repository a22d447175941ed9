"""Evaluation: per-sample records, unbiased pass@k, means with confidence intervals over seeds
and prompts, paired comparisons of checkpoints (`stats`, `records`); the offline evaluation of a
run's checkpoints behind `python -m megatron_rl.eval` (`runner`, `report`). See docs/evaluation.md."""
