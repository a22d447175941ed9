"""The checksum of a weight bucket: a BLAKE2b-128 digest of its packed bytes (`stream.pack_bucket`).

It serves twice in disaggregated mode (`disagg/weights.py`): the receiver checks each bucket's bytes against the
sender's digest before it loads any of them (corruption in transit), and the sender compares it with the digest of
the bucket the generators already hold to send only what changed (rollout.weight_sync_delta). The second use is
why a cryptographic hash and not a CRC: a bucket whose digest collides with the held one is not sent, so a collision
would leave stale weights in the engine without a word; at 128 bits that takes ~2^64 buckets.

The digest is a two-level tree so that large buckets hash on several threads (hashlib releases the GIL): BLAKE2b-128
of every `chunk_bytes` slice, then BLAKE2b-128 of the byte length (8 bytes, little-endian) followed by those leaf
digests. It depends on the bytes and `chunk_bytes` only, never on the thread count. A bucket on a GPU is copied to
the host first (the cost is in docs/rollout.md, "Delta weight sync and checksums").
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

DIGEST_SIZE = 16  # bytes: 32 hex digits
CHUNK_BYTES = 16 * 2**20
_PERSON = b"mrl-bucket"  # BLAKE2b personalisation: these digests never equal another protocol's


def bucket_digest(flat: torch.Tensor, chunk_bytes: int = CHUNK_BYTES, num_threads: int = 0) -> str:
    """The hex digest of `flat` (a 1-D uint8 tensor, the packed bucket). `num_threads` 0: up to 8, one per
    core, for buckets of several chunks."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"bucket_digest takes a packed bucket (1-D uint8), got {flat.dtype} of shape "
                         f"{tuple(flat.shape)}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    data = memoryview(flat.detach().cpu().contiguous().numpy())
    parts = [data[i:i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [data]

    def leaf(part: memoryview) -> bytes:
        return hashlib.blake2b(part, digest_size=DIGEST_SIZE, person=_PERSON).digest()

    threads = num_threads or min(8, os.cpu_count() or 1)
    if len(parts) == 1 or threads == 1:
        leaves = [leaf(p) for p in parts]
    else:
        with ThreadPoolExecutor(min(threads, len(parts))) as pool:
            leaves = list(pool.map(leaf, parts))
    root = hashlib.blake2b(len(data).to_bytes(8, "little"), digest_size=DIGEST_SIZE, person=_PERSON)
    for digest in leaves:
        root.update(digest)
    return root.hexdigest()
