"""A checkpoint's files (swarm/state/checkpoint.py has the layout and why): its index written and checked, a checkpoint
opened for reading with every piece located, and pieces read into the blocks a reader holds.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from swarm.errors import SwarmError
from swarm.state import tensorfile
from swarm.state.peerstate import TensorSpec
from swarm.tensors import byte_view, dtype_of

FORMAT, VERSION, INDEX = "swarm-checkpoint", 1, "index.json"
FILE = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")


class CorruptCheckpoint(SwarmError):
    pass


@dataclass
class Piece:
    """A block of a tensor at `offset` in the full tensor, stored as bytes [start, start + nbytes) of `file`."""

    file: BinaryIO
    start: int
    nbytes: int
    crc32: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass
class Opened:
    """A checkpoint opened for reading: every file open, so what is read is what was checked even if the writer
    prunes it meanwhile."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, tuple[TensorSpec, list[Piece]]]
    files: list[BinaryIO] = field(default_factory=list)

    def __enter__(self) -> Opened:
        return self

    def __exit__(self, *exc) -> None:
        for f in self.files:
            f.close()


def index_sha256(index: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in index.items() if k != "sha256"}, sort_keys=True).encode()
                          ).hexdigest()


def write_index(folder: Path, meta: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> None:
    """index.json of the checkpoint in `folder` (its safetensors files written), fsynced."""
    index = {"format": FORMAT, "version": VERSION, "meta": meta, "tensors": tensors}
    index["sha256"] = index_sha256(index)
    with open(folder / INDEX, "w") as f:
        json.dump(index, f)
        f.flush()
        os.fsync(f.fileno())


def tensor_entry(t: torch.Tensor, file: str, crc32: int) -> dict[str, Any]:
    """The index entry of a tensor stored whole, as one piece in `file`."""
    shape = list(t.shape)
    return {"dtype": tensorfile.dtype_name(t), "shape": shape,
            "pieces": [{"file": file, "offset": [0] * len(shape), "shape": shape, "crc32": crc32}]}


def overlap(piece: Piece, block: torch.Tensor, at: tuple[int, ...]) -> Optional[list[tuple[int, int]]]:
    """Per dimension, the [low, high) of the full tensor that both `piece` and the block at `at` cover."""
    spans = [(max(p, a), min(p + s, a + b)) for p, s, a, b in zip(piece.offset, piece.shape, at, block.shape)]
    return None if any(low >= high for low, high in spans) and math.prod(piece.shape) else spans


def place(piece: Piece, spec: TensorSpec, block: torch.Tensor, at: tuple[int, ...]) -> None:
    """Read the part of `piece` that overlaps `block` into it: straight into its memory where the piece is the
    block (a CPU tensor), else through one piece-sized buffer."""
    piece.file.seek(piece.start)
    if tuple(piece.offset) == tuple(at) and tuple(piece.shape) == tuple(block.shape):
        if block.device.type == "cpu" and block.is_contiguous():
            piece.file.readinto(memoryview(byte_view(block).numpy()))
        else:
            byte_view(block).copy_(torch.frombuffer(bytearray(piece.file.read(piece.nbytes)), dtype=torch.uint8))
        return
    data = torch.empty(piece.shape, dtype=dtype_of(spec.dtype))
    piece.file.readinto(memoryview(byte_view(data).numpy()))
    spans = overlap(piece, block, at)
    source = data[tuple(slice(low - p, high - p) for (low, high), p in zip(spans, piece.offset))]
    block[tuple(slice(low - a, high - a) for (low, high), a in zip(spans, at))].copy_(source)


def open_folder(path: Path) -> Opened:
    """Open the checkpoint folder `path` and check its index against its files (CorruptCheckpoint naming it)."""
    files: dict[str, tuple[BinaryIO, dict[str, tensorfile.Stored]]] = {}
    opened = Opened(path, {}, {})
    try:
        index = json.loads((path / INDEX).read_bytes())
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise ValueError(f"format {index.get('format')!r} version {index.get('version')!r}, this version "
                             f"reads {FORMAT!r} version {VERSION}")
        if index.get("sha256") != index_sha256(index):
            raise ValueError("its index fails its checksum")
        if not isinstance(index["meta"], dict) or not isinstance(index["tensors"], dict):
            raise ValueError("its index's meta or tensors is not a mapping")
        opened.meta = index["meta"]
        for name, entry in index["tensors"].items():
            spec = TensorSpec.from_list([name, entry["dtype"], entry["shape"]])
            dtype_of(spec.dtype)
            pieces = []
            for p in entry["pieces"]:
                if not (isinstance(p["file"], str) and FILE.fullmatch(p["file"])):
                    raise ValueError(f"{name}: bad file name {str(p['file'])[:80]!r}")
                if p["file"] not in files:
                    f = open(path / p["file"], "rb")
                    opened.files.append(f)
                    files[p["file"]] = (f, tensorfile.read_header(f)[1])
                f, stored = files[p["file"]][0], files[p["file"]][1].get(name)
                offset, shape = tuple(p["offset"]), tuple(p["shape"])
                if stored is None or (stored.dtype, stored.shape) != (spec.dtype, shape) or len(offset) != len(
                        spec.shape) or any(o < 0 or o + s > d for o, s, d in zip(offset, shape, spec.shape)):
                    raise ValueError(f"{name}: its piece in {p['file']} does not match the index")
                pieces.append(Piece(f, stored.start, stored.nbytes, int(p["crc32"]), offset, shape))
            if sum(math.prod(p.shape) for p in pieces) != math.prod(spec.shape):
                raise ValueError(f"{name}: its pieces do not cover it")
            opened.tensors[name] = (spec, pieces)
    except (OSError, ValueError, KeyError, TypeError) as e:  # missing, unreadable, bad JSON, wrong structure
        opened.__exit__()
        raise CorruptCheckpoint(f"corrupt checkpoint {path}: {type(e).__name__}: {e}") from None
    return opened
