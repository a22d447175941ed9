"""What importing megatron-core brings along that this project never uses, left out at import time.

Importing megatron-core costs ~5-6 s per process on these CPUs, ~3.5 s of it for two things:

- `megatron/core/jit.py:33` (`enable_jit_fuser()`) makes `jit_fuser` `torch.compile`, and ~40
  functions are decorated with it as their modules load (`fusions/fused_bias_geglu.py`,
  `activations.py`, `transformer/moe/experts.py`, ...): each decoration imports torch._dynamo and
  torch._inductor (~1.5 s). Without CUDA the compiled fusions are no use (inductor would generate
  C++ on their first call); megatron-core's own `disable_jit_fuser()` makes them plain functions,
  so it is called right after `megatron.core.jit` loads, on hosts without CUDA only.
- `inference/contexts/dynamic_context.py:70`, `inference/engines/dynamic_engine.py:78` and
  `timers.py:13` import wandb when it is installed (~1 s) for megatron's own inference engine and
  training timers, which this project does not run: while one of those modules loads, `import
  wandb` fails in the loading thread (their `except ImportError` branch), unless wandb is already
  imported. Other threads, and the run's own W&B logging later, import it as usual.

Every rank of every job pays the import, and the test suite starts hundreds of such processes.
`install()` (called by `import megatron_rl`) puts a finder first on `sys.meta_path` that wraps
only those four modules' loaders; it must come before megatron-core is imported, which no
library hook offers. `tests/distributed/test_megatron_import.py` shows that upstream still imports
both without it, and that it leaves them out.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable, Iterator, Optional, Sequence

JIT = "megatron.core.jit"
WANDB_IMPORTERS = ("megatron.core.inference.contexts.dynamic_context", "megatron.core.inference.engines.dynamic_engine",
                   "megatron.core.timers")


def _cuda_available() -> bool:
    import torch  # already imported: megatron.core.jit's package imported it

    return torch.cuda.is_available()


def _after_jit(module: ModuleType) -> None:
    if not _cuda_available():
        module.disable_jit_fuser()


# Threads loading one of WANDB_IMPORTERS: `import wandb` fails in them (and only in them) meanwhile.
_hiding: set[int] = set()


@contextlib.contextmanager
def _wandb_hidden() -> Iterator[None]:
    """An `import wandb` in this thread raises ImportError meanwhile, unless wandb is already imported
    (then `import` takes it from sys.modules without asking the finders)."""
    thread = threading.get_ident()
    nested = thread in _hiding
    _hiding.add(thread)
    try:
        yield
    finally:
        if not nested:
            _hiding.discard(thread)


class _WrappedLoader(importlib.abc.Loader):
    """The module's own loader, with `around` held over its execution and `after` called once it ran."""

    def __init__(self, loader: importlib.abc.Loader, around: Callable[[], contextlib.AbstractContextManager],
                 after: Callable[[ModuleType], None]) -> None:
        self._loader, self._around, self._after = loader, around, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with self._around():
            self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str):  # get_code, get_resource_reader, is_package, ...
        if name == "_loader" or name.startswith("__"):  # not set yet (copy, pickle) or a protocol probe
            raise AttributeError(name)
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        if fullname == "wandb" and threading.get_ident() in _hiding:
            raise ModuleNotFoundError("wandb is not imported for megatron-core (megatron_rl/parallel/"
                                      "megatron_import.py)", name="wandb")
        if fullname != JIT and fullname not in WANDB_IMPORTERS:
            return None
        spec = self._next_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        if fullname == JIT:
            spec.loader = _WrappedLoader(spec.loader, contextlib.nullcontext, _after_jit)
        else:
            spec.loader = _WrappedLoader(spec.loader, _wandb_hidden, lambda module: None)
        return spec

    def _next_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType]):
        """The spec the finders after this one give."""
        later = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else sys.meta_path
        for finder in later:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                return spec
        return None


def install() -> None:
    """Idempotent; a no-op for modules already imported."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
