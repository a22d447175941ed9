"""Disaggregated (asynchronous) RL: generator processes generate while the trainer trains,
connected by an experience buffer with bounded staleness (`rollout.mode=disaggregated`)."""
