"""Memory time-sharing between the trainer and the rollout engines on the same devices."""
