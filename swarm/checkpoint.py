"""Checkpoints at round boundaries: named tensors written raw, an index at the end, atomic and checksummed.

File layout (`checkpoint.pt`):

    [tensor bytes, each starting on a 64-byte boundary] [index: JSON] [index crc32: u32 LE]
    [index length: u64 LE] [MAGIC: 8 bytes]

The index is `{"meta": {...}, "tensors": [[name, dtype, shape, offset, nbytes, crc32], ...]}`. Writing streams
each live tensor's bytes to the file (no serialized copy of the state in memory); reading checks the
footer, the index, every offset and length against the file's size and every tensor's crc32 BEFORE
anything is loaded, then reads each tensor straight into the tensor the caller gives for its name. A
truncated or damaged file raises `CorruptCheckpoint` naming it, and leaves the caller's tensors untouched.
The good file is only ever replaced by a rename of a complete, fsynced temp file, so a crash mid-write
never destroys the last good checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

from swarm.errors import SwarmError
from swarm.state import TensorSpec, byte_view

MAGIC = b"SWRMCKP2"
FILENAME = "checkpoint.pt"
ALIGN = 64
PIECE = 2**24  # bytes read or written at a time
FOOTER = struct.Struct("<IQ")


class CorruptCheckpoint(SwarmError):
    pass


def _cpu_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(byte_view(t.detach().cpu().contiguous()).numpy())


class Checkpointer:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.path = self.dir / FILENAME

    def exists(self) -> bool:
        return self.path.exists()

    def save(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp.{os.getpid()}")
        entries, offset = [], 0
        with open(tmp, "wb") as f:
            for name, t in tensors.items():
                f.write(b"\0" * (-offset % ALIGN))
                offset += -offset % ALIGN
                data = _cpu_bytes(t)
                crc = 0
                for start in range(0, len(data), PIECE):
                    crc = zlib.crc32(data[start:start + PIECE], crc)
                    f.write(data[start:start + PIECE])
                entries.append([*TensorSpec.of(name, t).to_list(), offset, len(data), crc])
                offset += len(data)
            index = json.dumps({"meta": meta, "tensors": entries}).encode()
            f.write(index + FOOTER.pack(zlib.crc32(index), len(index)) + MAGIC)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def read_index(self) -> tuple[dict[str, Any], list[tuple[TensorSpec, int, int, int]]]:
        """(meta, [(spec, offset, nbytes, crc32)]) after checking the footer, index and every checksum."""
        origin = str(self.path)
        try:
            with open(self.path, "rb") as f:
                size, tail = f.seek(0, os.SEEK_END), FOOTER.size + len(MAGIC)
                if size < tail:
                    raise CorruptCheckpoint(f"corrupt checkpoint {origin}: {size} bytes, too short")
                f.seek(size - tail)
                (index_crc, length), magic = FOOTER.unpack(f.read(FOOTER.size)), f.read(len(MAGIC))
                if magic != MAGIC or length > size - tail:
                    raise CorruptCheckpoint(f"corrupt checkpoint {origin}: bad footer (truncated or not a checkpoint)")
                f.seek(size - tail - length)
                raw = f.read(length)
                if zlib.crc32(raw) != index_crc:
                    raise CorruptCheckpoint(f"corrupt checkpoint {origin}: its index fails its checksum")
                index = json.loads(raw)
                meta, entries = index["meta"], [_entry(e, size - tail - length) for e in index["tensors"]]
                for spec, offset, nbytes, crc in entries:
                    f.seek(offset)
                    got = 0
                    for start in range(0, nbytes, PIECE):
                        got = zlib.crc32(f.read(min(PIECE, nbytes - start)), got)
                    if got != crc:
                        raise CorruptCheckpoint(f"corrupt checkpoint {origin}: {spec.name} fails its checksum")
        except CorruptCheckpoint:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable, bad JSON, wrong index structure
            raise CorruptCheckpoint(f"corrupt checkpoint {origin}: {type(e).__name__}: {e}") from None
        return meta, entries

    def load(self, destinations: Callable[[list[TensorSpec]], dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Check the whole file, then read every tensor into `destinations(specs)[name]`; return the meta.
        `destinations` raises ValueError for a state that does not fit this peer (a CorruptCheckpoint here)."""
        meta, entries = self.read_index()
        try:
            targets = destinations([spec for spec, *_ in entries])
        except ValueError as e:
            raise CorruptCheckpoint(f"checkpoint {self.path} does not fit this model: {e}") from None
        with open(self.path, "rb") as f:
            for spec, offset, nbytes, _ in entries:
                target = targets[spec.name]
                f.seek(offset)
                if target.device.type == "cpu" and target.is_contiguous():
                    f.readinto(memoryview(byte_view(target).numpy()))
                else:
                    byte_view(target).copy_(torch.frombuffer(bytearray(f.read(nbytes)), dtype=torch.uint8))
        return meta

    def load_all(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every tensor as a fresh CPU tensor, and the meta (for tests and tools)."""
        tensors: dict[str, torch.Tensor] = {}

        def fresh(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
            from swarm.state import dtype_of
            tensors.update({s.name: torch.empty(s.shape, dtype=dtype_of(s.dtype)) for s in specs})
            return tensors
        meta = self.load(fresh)
        return tensors, meta


def _entry(item: object, data_end: int) -> tuple[TensorSpec, int, int, int]:
    if not (isinstance(item, list) and len(item) == 6):
        raise ValueError(f"malformed index entry {str(item)[:80]}")
    spec = TensorSpec.from_list(item[:3])
    offset, nbytes, crc = item[3:]
    if not all(isinstance(v, int) for v in (offset, nbytes, crc)) or nbytes != spec.nbytes \
            or not 0 <= offset <= offset + nbytes <= data_end:
        raise ValueError(f"index entry for {spec.name} does not fit the file")
    return spec, offset, nbytes, crc


