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

Cost at 85M parameters (1.36 GB of global parameters, momentum and moments): the moments are written while
the round averages, the rest and the fsync while the next round's inner steps run; the round waits only if
those take longer (bench/scale.py reports what is left as `overhead_s`).
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from swarm.errors import SwarmError
from swarm.state import TensorSpec
from swarm.tensors import byte_view, dtype_of

MAGIC = b"SWRMCKP2"
FILENAME = "checkpoint.pt"
ALIGN = 64
PIECE = 2**24  # bytes read or written at a time
FOOTER = struct.Struct("<IQ")


class CorruptCheckpoint(SwarmError):
    pass


def _write(f, offset: int, t: torch.Tensor) -> int:
    """Write `t`'s bytes at `offset`; their crc32."""
    data, crc = memoryview(byte_view(t.detach().cpu().contiguous()).numpy()), 0
    f.seek(offset)
    for start in range(0, len(data), PIECE):
        crc = zlib.crc32(data[start:start + PIECE], crc)
        f.write(data[start:start + PIECE])
    return crc


class Checkpointer:
    """Writes and reads one peer's checkpoint file, in two parts written by background threads, so that a
    round's checkpoint costs the round almost nothing:

    - `begin(tensors)` once a round's inner steps are done, with the tensors the next inner step changes
      (the AdamW moments): they stay put while the round averages. Call `wait_begun()` before changing them.
    - `commit(tensors, meta)` once the round committed, with the rest (global parameters and outer momentum,
      which change only at the next outer step): then the index, fsync and the rename into place. Call
      `wait()` before changing them, and before the process exits. `abort()` drops a begun checkpoint
      whose round was discarded. `save(tensors, meta)` writes a whole checkpoint and returns when it is on disk.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.path = self.dir / FILENAME
        self._tmp = self.path.with_suffix(f".tmp.{os.getpid()}")
        self._file = None
        self._entries: list[list] = []
        self._begun: Optional[threading.Thread] = None
        self._committing: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def exists(self) -> bool:
        self.wait()
        return self.path.exists()

    def _run(self, work: Callable[[], None]) -> threading.Thread:
        def guarded() -> None:
            try:
                work()
            except BaseException as e:  # surfaced by wait(); the last good checkpoint stays in place
                self._error = self._error or e
        thread = threading.Thread(target=guarded, name="checkpoint", daemon=False)
        thread.start()
        return thread

    def _append(self, tensors: dict[str, torch.Tensor]) -> None:
        offset = self._entries[-1][3] + self._entries[-1][4] if self._entries else 0
        for name, t in tensors.items():
            offset += -offset % ALIGN
            crc = _write(self._file, offset, t)
            self._entries.append([*TensorSpec.of(name, t).to_list(), offset, t.numel() * t.element_size(), crc])
            offset += self._entries[-1][4]

    def begin(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start a checkpoint: write `tensors` (they must not change until `wait_begun()`) in the background."""
        self.wait()
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(f"{FILENAME}.tmp.*"):  # left by a process that died mid-write
            stale.unlink(missing_ok=True)
        self._file, self._entries = open(self._tmp, "wb"), []
        self._begun = self._run(lambda: self._append(tensors))

    def wait_begun(self) -> None:
        if self._begun is not None:
            self._begun.join()
            self._begun = None

    def commit(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Finish the begun checkpoint with `tensors` (they must not change until `wait()`) and `meta`."""
        begun = self._begun

        def finish() -> None:
            if begun is not None:
                begun.join()
            try:
                if self._error is not None:
                    return
                self._append(tensors)
                index = json.dumps({"meta": meta, "tensors": self._entries}).encode()
                end = self._entries[-1][3] + self._entries[-1][4] if self._entries else 0
                self._file.seek(end)
                self._file.write(index + FOOTER.pack(zlib.crc32(index), len(index)) + MAGIC)
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                os.replace(self._tmp, self.path)
            finally:
                self._close()
        self._begun = None
        self._committing = self._run(finish)

    def abort(self) -> None:
        """Drop the begun checkpoint (its round was discarded); the last good one stays."""
        self.wait_begun()
        self._close()

    def _close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        self._file = None
        self._tmp.unlink(missing_ok=True)

    def close(self) -> None:
        """When training stops, normally or not: finish a committed checkpoint, drop one never committed."""
        if self._committing is None:
            self.abort()
        self.wait()

    def save(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Write a whole checkpoint now (not in the background)."""
        self.begin({})
        self.commit(tensors, meta)
        self.wait()

    def wait(self) -> None:
        """Until the last checkpoint is complete on disk (or dropped); re-raises what went wrong writing it."""
        self.wait_begun()
        if self._committing is not None:
            self._committing.join()
            self._committing = None
        if self._error is not None:
            error, self._error = self._error, None
            self._close()
            raise SwarmError(f"cannot write checkpoint {self.path}: {error}") from error

    def load(self, destinations: Callable[[list[TensorSpec]], dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Check the whole file, then read every tensor into `destinations(specs)[name]`; return the meta.
        `destinations` raises ValueError for a state that does not fit this peer (a CorruptCheckpoint here).
        The file is opened once: what is read is what was checked, even if a newer checkpoint is renamed
        into place meanwhile."""
        with self._open() as f:
            meta, entries = self._check(f)
            try:
                targets = destinations([spec for spec, *_ in entries])
            except ValueError as e:
                raise CorruptCheckpoint(f"checkpoint {self.path} does not fit this model: {e}") from None
            for spec, offset, nbytes, _ in entries:
                target = targets[spec.name]
                f.seek(offset)
                if target.device.type == "cpu" and target.is_contiguous():
                    f.readinto(memoryview(byte_view(target).numpy()))
                else:
                    byte_view(target).copy_(torch.frombuffer(bytearray(f.read(nbytes)), dtype=torch.uint8))
        return meta

    def _open(self):
        self.wait()
        try:
            return open(self.path, "rb")
        except OSError as e:
            raise CorruptCheckpoint(f"corrupt checkpoint {self.path}: {type(e).__name__}: {e}") from None

    def _check(self, f) -> tuple[dict[str, Any], list[tuple[TensorSpec, int, int, int]]]:
        origin = str(self.path)
        try:
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

    def load_all(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every tensor as a fresh CPU tensor, and the meta (for tests and tools)."""
        tensors: dict[str, torch.Tensor] = {}

        def fresh(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
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


