"""Generated gRPC stubs for `sandbox.proto`.

`setup.py` generates them at install/build time into `_generated/` (ignored by git). If
they are missing or older than the .proto (a source checkout after an edit), they are
regenerated here with grpc_tools before import; files are written to a temporary name
and renamed so that concurrent processes never import a half-written module.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path

# The largest request or reply either side accepts unless configured (server --max-message-bytes,
# SandboxClient(max_message_bytes=)): both sides must agree, or a reply the server sends is lost at
# the client (gRPC's own client default is 4 MiB).
DEFAULT_MESSAGE_BYTES = 256 * 2**20

PROTO = Path(__file__).resolve().parent / "sandbox.proto"
GENERATED = Path(__file__).resolve().parent / "_generated"
_MODULES = ("sandbox_pb2.py", "sandbox_pb2_grpc.py", "sandbox_pb2.pyi")


def _stale() -> bool:
    return any(not (GENERATED / m).exists() or (GENERATED / m).stat().st_mtime < PROTO.stat().st_mtime
               for m in _MODULES)


def generate(out_dir: Path = GENERATED) -> None:
    """Run protoc (from grpcio-tools) on sandbox.proto into `out_dir`."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise ImportError("the sandbox stubs need grpcio-tools: pip install grpcio-tools") from exc
    import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        include = str(Path(grpc_tools.__file__).parent / "_proto")
        code = protoc.main(["protoc", f"-I{PROTO.parent}", f"-I{include}", f"--python_out={tmp}",
                            f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", str(PROTO)])
        if code != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
        for name in _MODULES:
            os.replace(Path(tmp) / name, out_dir / name)


def load():
    """(sandbox_pb2, sandbox_pb2_grpc), generating them first if needed."""
    if _stale():
        generate()
    if str(GENERATED) not in sys.path:
        sys.path.insert(0, str(GENERATED))  # the generated grpc module imports `sandbox_pb2` by that name
    return importlib.import_module("sandbox_pb2"), importlib.import_module("sandbox_pb2_grpc")


if __name__ == "__main__":
    generate()
