"""Checks on the fields of a request before any work: lengths, characters and ranges.

A malformed request is refused with a `WorkspaceError` (INVALID_ARGUMENT, final: the client does
not retry it) whose message names the field and never repeats the client's value whole: error
details travel in gRPC's trailing metadata, and an echoed 1 MB path made the reply itself fail.
Paths are checked by `workspace.check_path`.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from megatron_rl_sandbox.workspace import WorkspaceError, check_path, shown

MAX_KEY_CHARS = 128  # idempotency keys (request ids)
MAX_IMAGE_CHARS = 256
MAX_ARGS = 4096
MAX_ARGV_BYTES = 1 * 2**20  # below the kernel's ARG_MAX (2 MiB with an 8 MiB stack), with the environment
MAX_FILES = 10_000
_ID = re.compile(r"[0-9a-f]{32}")  # session and snapshot ids: uuid4().hex
_KEY = re.compile(r"[\x21-\x7e]*")  # printable ASCII, no space
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_id(value: str, what: str) -> str:
    if not _ID.fullmatch(value):
        raise WorkspaceError(f"{what} {shown(value, 40)} is not an id this server gives out (32 hex digits)")
    return value


def check_key(key: str) -> None:
    if len(key) > MAX_KEY_CHARS or not _KEY.fullmatch(key):
        raise WorkspaceError(f"idempotency_key must be at most {MAX_KEY_CHARS} printable ASCII characters "
                             f"(got {len(key)} characters)")


def check_image(image: str) -> None:
    if len(image) > MAX_IMAGE_CHARS or any(ord(c) < 32 for c in image):
        raise WorkspaceError(f"image name {shown(image, 40)} is longer than {MAX_IMAGE_CHARS} characters or "
                             f"holds a control character")


def check_command(argv: Iterable[str], env: Mapping[str, str]) -> None:
    argv = list(argv)
    if len(argv) > MAX_ARGS:
        raise WorkspaceError(f"argv has {len(argv)} arguments, more than {MAX_ARGS}")
    size = sum(len(a.encode()) + 1 for a in argv) + sum(len(k.encode()) + len(v.encode()) + 2
                                                        for k, v in env.items())
    if size > MAX_ARGV_BYTES:
        raise WorkspaceError(f"argv and env hold {size} bytes, more than {MAX_ARGV_BYTES}")
    if any("\x00" in a for a in argv):
        raise WorkspaceError("an argument of argv contains a NUL character")
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise WorkspaceError(f"environment variable name {shown(name, 40)} is not [A-Za-z_][A-Za-z0-9_]*")
        if "\x00" in value:
            raise WorkspaceError(f"environment variable {name} contains a NUL character")


def check_files(files: Iterable) -> None:
    files = list(files)
    if len(files) > MAX_FILES:
        raise WorkspaceError(f"{len(files)} files in one request, more than {MAX_FILES}")
    for f in files:
        check_path(f.path)
