"""The import hook of `megatron_rl/parallel/megatron_import.py`, in fresh interpreters: megatron-core
alone still imports torch._dynamo (its `jit_fuser` decorations) and wandb (when installed), so the
hook is still needed; after `import megatron_rl` neither is imported, the decorated functions
compute what their formulas say, and the run's own `import wandb` still works. With CUDA the
compiled fusions are kept, so the torch._dynamo half runs on CPU-only hosts only."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
CPU_ONLY = not torch.cuda.is_available()
MODULES = ("megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
           "megatron.core.inference.engines.dynamic_engine", "megatron.core.timers")
PROBE = f"""
import importlib, json, sys
{{first}}
for name in {MODULES!r}:
    importlib.import_module(name)
import torch
from megatron.core import jit, timers
from megatron.core.fusions.fused_bias_geglu import quick_gelu
state = {{{{"dynamo": "torch._dynamo" in sys.modules, "wandb": "wandb" in sys.modules,
          "jit_fuser": jit.jit_fuser.__name__, "timers_wandb": getattr(timers.wandb, "__name__", None)}}}}
if jit.jit_fuser.__name__ != "compile":  # a compiled one would run inductor's C++ code generation (~20 s)
    x = torch.linspace(-3, 3, 13)
    state["quick_gelu_error"] = float((quick_gelu(x) - x * torch.sigmoid(1.702 * x)).abs().max())
if {HAVE_WANDB!r}:
    import wandb
    state["wandb_after"] = hasattr(wandb, "init")
print(json.dumps(state))
"""


def _probe(first: str) -> dict:
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE.format(first=first)], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_megatron_core_alone_still_imports_dynamo_and_wandb():
    state = _probe("")
    assert state["wandb"] == HAVE_WANDB and state["timers_wandb"] == ("wandb" if HAVE_WANDB else None)
    if CPU_ONLY:
        assert state["dynamo"] and state["jit_fuser"] == "compile"


def test_after_import_megatron_rl_neither_is_imported_and_the_fusions_still_compute():
    state = _probe("import megatron_rl")
    assert not state["wandb"] and state["timers_wandb"] is None
    if HAVE_WANDB:
        assert state["wandb_after"]  # hidden from megatron-core only while its modules load
    if CPU_ONLY:
        assert not state["dynamo"] and state["jit_fuser"] == "noop_decorator"
        assert state["quick_gelu_error"] < 1e-6
    else:
        assert state["jit_fuser"] == "compile"


@pytest.mark.skipif(not HAVE_WANDB, reason="needs wandb (pip install -e '.[wandb]')")
def test_wandb_imported_before_megatron_core_is_what_it_gets():
    assert _probe("import megatron_rl, wandb")["timers_wandb"] == "wandb"
