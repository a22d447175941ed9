"""Rewards: rule verifiers (math answers, exact match) and sandbox verifiers (code really
executed in the sandbox service), computed asynchronously while generation goes on."""
