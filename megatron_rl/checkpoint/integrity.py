"""Checksum manifests of training checkpoints: what a save writes so that damage done afterwards (a file
truncated, zeroed, changed or deleted) is found, and the checks that find it, naming the file and the kind
of damage.

`manifest.json` beside a checkpoint's files holds the size and SHA-256 of every file but meta.json. Each rank
hashes the files it wrote and rank 0 the rest (`write_manifest`); verifying deals the files out over the ranks
(`damage_over_ranks`). Checkpoints written before manifests cannot be verified and are accepted
with a warning. Choosing which checkpoint to resume from is `training.find_intact`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_META = "meta.json"
# hashlib's SHA-256 runs on the SHA extensions of x86 and ARM CPUs: ~0.7-0.9 GB/s a core, as fast as SHA-1 and
# 2.5-3 times MD5 or BLAKE2b there (docs/checkpoints.md, "Damaged checkpoints").
_HASH = "sha256"


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match its manifest; `problems` holds "<file>: <damage>" each."""

    def __init__(self, path: Path, problems: list[str], message: Optional[str] = None) -> None:
        self.path, self.problems = Path(path), list(problems)
        super().__init__(message or f"checkpoint {path} is damaged: {'; '.join(problems)}")


def _digest(path: Path, algorithm: str = _HASH) -> str:
    digest = hashlib.new(algorithm)
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _manifest_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, _HASH: _digest(path)}


def _own_files(tmp: Path, rank: int) -> list[str]:
    """The files of the save in `tmp` this rank wrote: torch_dist's `__<rank>_<n>.distcp` and its RNG
    states. It hashes them while they are still in its node's page cache; whatever no rank claims (the
    common state, the metadata, any file Megatron names otherwise) rank 0 hashes."""
    mine = sorted(tmp.glob(f"__{rank}_*.distcp")) + [tmp / "rng" / f"rank{rank}.pt"]
    return [p.relative_to(tmp).as_posix() for p in mine if p.is_file()]


def write_manifest(tmp: Path, rank: int) -> None:
    """manifest.json of the save in `tmp`: size and digest of every file but meta.json. Every rank calls
    this once all ranks' files are complete (after a barrier); each hashes its own files, rank 0 gathers
    them, hashes the rest and writes the manifest (fsynced)."""
    entries = {name: _manifest_entry(tmp / name) for name in _own_files(tmp, rank)}
    parts: list[Any] = [entries]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, entries)
    if rank != 0:
        return
    files = {name: entry for part in parts for name, entry in part.items()}
    for path in sorted(tmp.rglob("*")):
        name = path.relative_to(tmp).as_posix()
        if path.is_file() and name not in files and name not in (_META, MANIFEST):
            files[name] = _manifest_entry(path)
    with open(tmp / MANIFEST, "w") as f:
        json.dump({"algorithm": _HASH, "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_damage(path: Path, checksums: bool = True, rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with the complete checkpoint `path`, as "<file>: <damage>" (empty: intact): a file of
    its manifest missing, of another size, or (with `checksums`) of another digest; no manifest where
    meta.json says the save wrote one; meta.json or the manifest unreadable. With `rank` and `world_size`,
    only that rank's share of the files (the ranks split the reading: `damage_over_ranks`).

    A checkpoint written before manifests existed (meta.json without "manifest") cannot be checked: it
    is accepted as it is, with a warning."""
    path = Path(path)
    try:
        meta = json.loads((path / _META).read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as exc:
        return [f"{_META}: unreadable ({exc})"]
    if not (path / MANIFEST).is_file():
        if meta.get("manifest"):
            return [f"{MANIFEST}: missing (no manifest; meta.json says the save wrote one)"]
        logger.warning("checkpoint %s was written before checksum manifests: its files cannot be verified", path)
        return []
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        algorithm, files = manifest["algorithm"], manifest["files"]
        hashlib.new(algorithm)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{MANIFEST}: unreadable ({type(exc).__name__}: {exc})"]
    problems = []
    # the biggest files dealt round first: every rank reads about as much
    for name in sorted(files, key=lambda n: (-files[n]["size"], n))[rank::world_size]:
        entry, file = files[name], path / name
        if not file.is_file():
            problems.append(f"{name}: missing")
        elif (size := file.stat().st_size) != entry["size"]:
            problems.append(f"{name}: size mismatch ({size} bytes, the manifest says {entry['size']})")
        elif checksums and _digest(file, algorithm) != entry[algorithm]:
            problems.append(f"{name}: checksum mismatch ({algorithm} differs from the manifest's)")
    return problems


def damage_over_ranks(path: Path) -> list[str]:
    """`checkpoint_damage` of the whole checkpoint, each rank reading its share of the files; every rank
    gets every problem. Collective when the process group has several ranks."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return checkpoint_damage(path)
    world_size = dist.get_world_size()
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, checkpoint_damage(path, rank=dist.get_rank(), world_size=world_size))
    return sorted(dict.fromkeys(problem for part in parts for problem in part))


def refuse_damaged(path: Path, checksums: bool = True) -> None:
    """Raise DamagedCheckpoint when `path` does not match its manifest (collective when distributed;
    `checksums` False: names and sizes only, which reads no file: `checkpoint_damage`)."""
    problems = damage_over_ranks(path) if checksums else checkpoint_damage(path, checksums=False)
    if problems:
        raise DamagedCheckpoint(path, problems)
