"""Sandbox runtimes behind one interface: `bwrap` (bubblewrap; the default where Apptainer is
absent), `apptainer` (SIF or sandbox-directory images, rootless), and `process` (rlimits and
cgroups only: it isolates nothing and refuses to start unless explicitly allowed)."""

from __future__ import annotations

from typing import Any

from megatron_rl_sandbox.runtimes.base import Runtime, RuntimeError_

RUNTIMES = ("bwrap", "apptainer", "process")


def make_runtime(name: str, **options: Any) -> Runtime:
    if name == "bwrap":
        from megatron_rl_sandbox.runtimes.bwrap import BwrapRuntime

        return BwrapRuntime(**options)
    if name == "apptainer":
        from megatron_rl_sandbox.runtimes.apptainer import ApptainerRuntime

        return ApptainerRuntime(**options)
    if name == "process":
        from megatron_rl_sandbox.runtimes.process import ProcessRuntime

        return ProcessRuntime(**options)
    raise ValueError(f"sandbox runtime {name!r} is unknown; use one of {', '.join(RUNTIMES)}")


__all__ = ["Runtime", "RuntimeError_", "make_runtime", "RUNTIMES"]
