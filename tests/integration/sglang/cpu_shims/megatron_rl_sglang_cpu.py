"""Start-up hook of the SGLang CPU test venv (imported from a .pth file by ../setup.sh).

1. PyPI's torchvision wheels are CUDA builds: their `_C` extension cannot load against the
   CPU torch wheel, yet `torchvision._meta_registrations` registers fake kernels for
   `torchvision::nms` / `qnms` unconditionally and fails when those ops have no schema.
   Defining the two schemas first lets `import torchvision` (which SGLang and transformers
   do) succeed; the ops themselves are never called. The schemas are defined lazily, the first
   time anything looks for torchvision, so interpreters that never touch it (pip) stay fast.
2. SGLANG_USE_CPU_ENGINE=1 by default: without it SGLang imports vllm for rotary embeddings.
3. The checkout's packages installed under other names (setup.py's package_dir:
   `megatron_rl_sandbox` -> sandbox/, `megatron_rl_kernels` -> kernels/) are found in the
   checkout on sys.path, as an editable install finds them; this venv only has the checkout
   on its path (a .pth file), not the package installed.

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


_ALIASES = {"megatron_rl_sandbox": "sandbox", "megatron_rl_kernels": "kernels"}


class _CheckoutAliasFinder(MetaPathFinder):
    """`megatron_rl_kernels` -> <checkout>/kernels (and the sandbox), the checkout being the
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
