"""Rollout engines (token-in / token-out) behind one protocol: `hf` (transformers; the CPU
default and numerical reference) and `sglang` (the production path; the only module that
imports sglang). `make_engine(cfg)` builds the configured one."""
