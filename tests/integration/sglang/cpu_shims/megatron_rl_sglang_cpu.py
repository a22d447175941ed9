"""Start-up hook of the SGLang CPU test venv (imported from a .pth file by ../setup.sh).

1. PyPI's torchvision wheels are CUDA builds: their `_C` extension cannot load against the
   CPU torch wheel, yet `torchvision._meta_registrations` registers fake kernels for
   `torchvision::nms` / `qnms` unconditionally and fails when those ops have no schema.
   Defining the two schemas first lets `import torchvision` (which SGLang and transformers
   do) succeed; the ops themselves are never called. The schemas are defined lazily, the first
   time anything looks for torchvision, so interpreters that never touch it (pip) stay fast.
2. SGLANG_USE_CPU_ENGINE=1 by default: without it SGLang imports vllm for rotary embeddings.
3. The checkout's packages installed under other names (setup.py's package_dir:
   `megatron_rl_sandbox` -> sandbox/, `megatron_rl_kernels` -> kernels/megatron_rl_kernels/) are found in the
   checkout on sys.path, as an editable install finds them; this venv only has the checkout
   on its path (a .pth file), not the package installed.
4. SGLang's LoRA serving (`sglang.srt.lora`) allocates its host-side index tensors pinned
   (`pin_memory=True`, `.pin_memory()`) whatever the device; torch refuses to pin without an
   accelerator. On a host without CUDA, pinning becomes a no-op (a plain host tensor, which is
   what the CPU engine uses them as), set up the first time anything looks for that package.
   Only calls that would otherwise raise behave differently.

Test infrastructure only; the package never imports this.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

# Library objects un-register their definitions when collected: keep them alive here.
_LIBRARIES: list = []
_TORCHVISION_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


class _TorchvisionSchemaFinder(MetaPathFinder):
    """Defines the torchvision op schemas just before torchvision is first looked up."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)  # once only, and before importing torch (no re-entry)
        import torch

        library = torch.library.Library("torchvision", "DEF")
        for schema in _TORCHVISION_OPS:
            library.define(schema)
        _LIBRARIES.append(library)
        return None  # let the regular finders import the real package


if not any(isinstance(finder, _TorchvisionSchemaFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionSchemaFinder())


_ALIASES = {"megatron_rl_sandbox": "sandbox", "megatron_rl_kernels": os.path.join("kernels", "megatron_rl_kernels")}


class _CheckoutAliasFinder(MetaPathFinder):
    """`megatron_rl_kernels` -> <checkout>/kernels/megatron_rl_kernels (and the sandbox), the checkout being the
    sys.path entry that holds megatron_rl/. Submodules then resolve through the package's
    __path__ with the regular finders."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _ALIASES:
            return None
        import importlib.util

        for entry in sys.path:
            root = os.path.join(entry or ".", _ALIASES[fullname])
            if os.path.isfile(os.path.join(entry or ".", "megatron_rl", "__init__.py")) and \
                    os.path.isfile(os.path.join(root, "__init__.py")):
                return importlib.util.spec_from_file_location(
                    fullname, os.path.join(root, "__init__.py"), submodule_search_locations=[root])
        return None


if not any(isinstance(finder, _CheckoutAliasFinder) for finder in sys.meta_path):
    sys.meta_path.append(_CheckoutAliasFinder())


_PINNED_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like")


class _PinMemoryFinder(MetaPathFinder):
    """Makes pinning a no-op on hosts without CUDA just before sglang.srt.lora is first looked up (item 4)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "sglang.srt.lora":
            return None
        sys.meta_path.remove(self)
        import functools

        import torch

        if torch.cuda.is_available():
            return None
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
        for name in _PINNED_FACTORIES:
            def unpinned(*args, _factory=getattr(torch, name), pin_memory=False, **kwargs):
                return _factory(*args, **kwargs)
            setattr(torch, name, functools.wraps(getattr(torch, name))(unpinned))
        return None


if not any(isinstance(finder, _PinMemoryFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PinMemoryFinder())
