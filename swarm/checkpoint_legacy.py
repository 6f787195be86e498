"""Reading checkpoints of the earlier format (`checkpoint.pt`, magic `SWRMCKP2`), so that they convert by use.

    [tensor bytes, each starting on a 64-byte boundary] [index: JSON] [index crc32: u32 LE]
    [index length: u64 LE] [MAGIC: 8 bytes]

The index is `{"meta": {...}, "tensors": [[name, dtype, shape, offset, nbytes, crc32], ...]}`, its tensors named
by position (`global.3`, `adam.3.exp_avg`). `entries` checks the footer, the index and every offset against the
file's size and gives each tensor's place; swarm/checkpoint.py reads such a file as it reads a checkpoint of the
current format (one piece per tensor, named by `StateNames` when the reader knows its model) and writes the next
checkpoint in the current format, after which the old file is deleted like any older checkpoint.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Any, BinaryIO

from swarm.state import TensorSpec

MAGIC = b"SWRMCKP2"
FILENAME = "checkpoint.pt"
FOOTER = struct.Struct("<IQ")


def entries(f: BinaryIO) -> tuple[dict[str, Any], list[tuple[TensorSpec, int, int, int]]]:
    """(meta, [(spec, offset, nbytes, crc32)]) of the legacy checkpoint `f`; ValueError naming what is wrong."""
    size, tail = f.seek(0, os.SEEK_END), FOOTER.size + len(MAGIC)
    if size < tail:
        raise ValueError(f"{size} bytes, too short")
    f.seek(size - tail)
    (index_crc, length), magic = FOOTER.unpack(f.read(FOOTER.size)), f.read(len(MAGIC))
    if magic != MAGIC or length > size - tail:
        raise ValueError("bad footer (truncated or not a checkpoint)")
    f.seek(size - tail - length)
    raw = f.read(length)
    if zlib.crc32(raw) != index_crc:
        raise ValueError("its index fails its checksum")
    index = json.loads(raw)
    meta, found = index["meta"], [_entry(e, size - tail - length) for e in index["tensors"]]
    if not isinstance(meta, dict):
        raise ValueError("the index's meta is not a mapping")
    return meta, found


def _entry(item: object, data_end: int) -> tuple[TensorSpec, int, int, int]:
    if not (isinstance(item, list) and len(item) == 6):
        raise ValueError(f"malformed index entry {str(item)[:80]}")
    spec = TensorSpec.from_list(item[:3])
    offset, nbytes, crc = item[3:]
    if not all(isinstance(v, int) for v in (offset, nbytes, crc)) or nbytes != spec.nbytes \
            or not 0 <= offset <= offset + nbytes <= data_end:
        raise ValueError(f"index entry for {spec.name} does not fit the file")
    return spec, offset, nbytes, crc
