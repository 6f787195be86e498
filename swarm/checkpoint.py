"""Checkpoints at round boundaries: atomic (temp file, fsync, rename) and checksummed.

File layout: 8 bytes of magic, 32 bytes of sha256 of the payload, then the payload (`torch.save`).
A truncated or corrupt file fails the checksum and raises `CorruptCheckpoint` naming the file; since
the good file is only ever replaced by a rename of a complete temp file, a crash mid-write never
destroys the last good checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any, Optional

import torch

from swarm.errors import SwarmError

MAGIC = b"SWRMCKP1"
FILENAME = "checkpoint.pt"


class CorruptCheckpoint(SwarmError):
    pass


def to_bytes(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return MAGIC + hashlib.sha256(payload).digest() + payload


def from_bytes(blob: bytes, origin: str) -> dict[str, Any]:
    """Inverse of `to_bytes`; raises CorruptCheckpoint naming `origin` on any mismatch."""
    if len(blob) < 40 or blob[:8] != MAGIC:
        raise CorruptCheckpoint(f"corrupt checkpoint {origin}: bad header")
    digest, payload = blob[8:40], blob[40:]
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"corrupt checkpoint {origin}: checksum mismatch (truncated or damaged)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # a payload that passed its checksum but does not unpickle is corrupt too
        raise CorruptCheckpoint(f"corrupt checkpoint {origin}: {type(e).__name__}: {e}") from None


class Checkpointer:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.path = self.dir / FILENAME

    def exists(self) -> bool:
        return self.path.exists()

    def save(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(to_bytes(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def load(self) -> Optional[dict[str, Any]]:
        if not self.path.exists():
            return None
        return from_bytes(self.path.read_bytes(), str(self.path))
