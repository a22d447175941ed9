"""Stand-in for `sgl_kernel` (PyPI `sglang-kernel`), which has no wheel for this CPU torch.

SGLang 0.5.23 imports kernels from it at module level (for example `memory_pool.py` imports
`copy_all_layer_kv_cache_cpu` when SGLANG_USE_CPU_ENGINE=1), but with
attention_backend="torch_native" and sampling_backend="pytorch" on a CPU without AMX it
calls none of them for dense Qwen2/Llama models. Every name imported from here is a
function that raises when called, so a code path that does need a real kernel fails with
its name instead of silently. `torch.ops.sgl_kernel` stays empty, which is how SGLang
detects that the Intel AMX backend is unavailable.

Test infrastructure only: installed into the SGLang test venv by ../setup.sh.
"""

from __future__ import annotations

from typing import Any, Callable


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing_kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this test venv has no sgl_kernel build "
            "(tests/integration/sglang/cpu_shims/sgl_kernel is a stand-in)"
        )

    missing_kernel.__name__ = name
    return missing_kernel
