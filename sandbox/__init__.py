"""megatron-rl's sandbox service (import name `megatron_rl_sandbox`, directory `sandbox/`).

A gRPC server for CPU nodes that executes untrusted, model-generated code under hard limits
in a bubblewrap or Apptainer container and returns what it did; and the client the trainer
uses. Usable on its own:

    python -m megatron_rl_sandbox.server --port 50051 --runtime bwrap --run-dir runs/my-job

See docs/sandbox.md for what the isolation covers and what it does not.
"""
