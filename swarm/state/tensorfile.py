"""safetensors files written and read a tensor at a time: the file format of checkpoints (swarm/state/checkpoint.py).

A safetensors file is `[header length: u64 LE] [header: JSON, space-padded to 8 bytes] [tensor bytes]`; the
header maps each tensor's name to its dtype, shape and byte range in the data (contiguous, in order) and holds
string metadata under `__metadata__`. `safetensors.torch.save_file` first turns every tensor into a `bytes`
copy, a second copy of the whole state in memory: `write` instead streams each live tensor's bytes to the file
(16 MiB at a time) and returns their crc32s. `read_header` parses and checks a header against the file's size
without reading any tensor, so a reader can check and then read each tensor straight into its own memory.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import torch

from swarm.tensors import byte_view

PIECE = 2**24  # bytes read or written at a time
MAX_HEADER = 100 * 2**20  # safetensors' own limit
CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "uint8": "U8"}
"""Our dtype names (swarm/tensors.py) and safetensors' codes for them."""
NAMES = {code: name for name, code in CODES.items()}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes lie in a safetensors file."""

    dtype: str  # our name: "float32", ...
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    nbytes: int


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def write(f: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, int]:
    """Write `tensors` as a safetensors file to `f` (open for writing, at 0); the crc32 of each one's bytes."""
    specs = [(name, dtype_name(t), tuple(t.shape)) for name, t in tensors.items()]
    return write_each(f, specs, lambda name: tensors[name], metadata)


def write_each(f: BinaryIO, specs: list[tuple[str, str, tuple[int, ...]]], tensor_of: Callable[[str], torch.Tensor],
               metadata: dict[str, str]) -> dict[str, int]:
    """Write a safetensors file of the tensors `specs` names (name, our dtype name, shape), in that order, to `f`
    (open for writing, at 0), asking `tensor_of(name)` for each one only when its bytes are written: a caller that
    makes each tensor then (reads it from a checkpoint, casts it) holds one at a time. The crc32 of each one's
    bytes; ValueError if a tensor does not match its spec."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    end = 0
    for name, dtype, shape in specs:
        if dtype not in CODES:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors code here")
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [end, end + nbytes]}
        end += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)) + raw)
    crcs = {}
    for name, dtype, shape in specs:
        t = tensor_of(name)
        if (dtype_name(t), tuple(t.shape)) != (dtype, shape):
            raise ValueError(f"{name} is {dtype_name(t)} {tuple(t.shape)}, its header says {dtype} {shape}")
        data, crc = memoryview(byte_view(t.detach().cpu().contiguous()).numpy()), 0
        for start in range(0, len(data), PIECE):
            crc = zlib.crc32(data[start:start + PIECE], crc)
            f.write(data[start:start + PIECE])
        crcs[name] = crc
        del t, data  # before the next tensor is asked for: one at a time
    return crcs


def read_header(f: BinaryIO) -> tuple[dict[str, str], dict[str, Stored]]:
    """(metadata, tensors) of the safetensors file `f`, checked against its size (nothing else is read).
    ValueError naming what does not fit."""
    size = f.seek(0, 2)
    f.seek(0)
    if size < 8:
        raise ValueError(f"{size} bytes, too short for a safetensors file")
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(MAX_HEADER, size - 8):
        raise ValueError(f"its header length {length} does not fit the file ({size} bytes): truncated?")
    header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("its header is not a mapping")
    metadata = header.pop("__metadata__", {}) or {}
    data_start, tensors = 8 + length, {}
    for name, entry in header.items():
        dtype, shape, (begin, end) = NAMES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
        if not all(type(d) is int and d >= 0 for d in shape) or not (type(begin) is type(end) is int):
            raise ValueError(f"malformed header entry for {name}")
        if end - begin != math.prod(shape) * ITEMSIZE[dtype] or not 0 <= begin <= end <= size - data_start:
            raise ValueError(f"{name}'s bytes [{begin}, {end}) do not fit its shape or the file ({size} bytes)")
        tensors[name] = Stored(dtype, shape, data_start + begin, end - begin)
    return metadata, tensors


def crc32(f: BinaryIO, start: int, nbytes: int) -> int:
    """The crc32 of bytes [start, start + nbytes) of `f`, read a piece at a time."""
    f.seek(start)
    crc = 0
    for at in range(0, nbytes, PIECE):
        crc = zlib.crc32(f.read(min(PIECE, nbytes - at)), crc)
    return crc
