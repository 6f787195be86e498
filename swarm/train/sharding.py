"""Sharded peers (`inner.parallel: fsdp` with `--nproc-per-node K`): FSDP2 inside the peer, and outer state in
shards, one swarm endpoint.

Inner steps: `shard_model` applies FSDP2's `fully_shard` to every transformer block and then to the root, so
each of the K ranks holds 1/K of every parameter (rows of dim 0, `torch.chunk`'s cut: rank r holds rows
[r * c, min(n, (r + 1) * c)) of a tensor of n rows, c = ceil(n / K), maybe none), of its gradient and of its
AdamW moments. Each rank trains on its rows of the peer's batch (as under DDP) and FSDP's reduce-scatter takes
the mean of the ranks' gradients, so K ranks take the step one process takes on the whole batch (up to float
rounding).

Outer state: every rank's `DiLoCo` holds the global parameters and the outer momentum of its own rows only, and
computes its rows of the pseudo-gradient and of the outer step (SGD is elementwise, so the rows of the full
step are the step of the rows). A row block of a row-major tensor is a contiguous range of its flat elements
(`Layout.span`), so the canonical layout of the state (the full tensors, in the model's order) is the same for
every K: peers of any K, sharded or not, average together and commit the same bytes.

The exchange: rank 0 stays the peer's one swarm endpoint (swarm/train/ranks.py), and the vectors it averages pass
through two node-local files (`NodeFile`, the canonical layout of the whole tensors): at an exchange's launch
every rank writes its rows of the pseudo-gradient into one, rank 0 averages it with the swarm chunk by chunk,
reading the chunks from that file and writing the average's into the other, and at the settle every rank reads
its own rows of the average back and takes the outer step on them. Everything goes through pread/pwrite, never a
mapping, so the vectors sit in the page cache (once per node; the kernel may write them back to the peer's
folder and evict them) and no rank holds more of them than the chunks in flight: rank 0's peak is the other
ranks' (bench/results/README.md section 10). No rank ever holds the full global parameters, momentum or moments.

The state's hash (swarm/state/statehash.py: global parameters, outer momentum, rounds closed) is the same as an
unsharded peer's: `sha256` is the same sha256 over the same bytes of the global parameters and momentum, rank 0
feeding it each tensor, gathered one at a time, and telling the others the digest. It is a collective: every rank
computes it at the same point (after each outer step, and where the state changed).

One rank (K = 1): `inner.parallel: fsdp` is the same as no sharding (nothing to shard over); `shard_model`
returns None and the peer trains unsharded.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from swarm.errors import UsageError
from swarm.state.statehash import tensor_bytes
from swarm.tensors import Buffers

BLOCK_LISTS = ("layers", "h", "blocks")  # attribute names of a model's list of transformer blocks
MMAP_THRESHOLD = 1 << 16  # bytes: glibc serves larger allocations from mmap, returned to the kernel when freed
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory() -> None:
    """Fix glibc's mmap threshold for this process. By default every freed mmap'd buffer raises it (up to 32 MB),
    so the buffers FSDP gathers and frees block after block, and the exchange's, end up in the heap, where freed
    memory stays resident: measured on a 57M-parameter model (bench/shards.py), a rank of K = 2 peaked at 1.66
    GB instead of 1.03 GB. Elsewhere (not glibc) nothing is changed."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class Layout:
    """The canonical shapes of a peer's state tensors (DiLoCo's order) and which rows of each a rank holds."""

    shapes: tuple[torch.Size, ...]
    world_size: int = 1
    rank: int = 0

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    def rows(self, index: int, rank: Optional[int] = None) -> tuple[int, int]:
        """Rows [start, end) of dim 0 of tensor `index` that `rank` (default: this one) holds."""
        rank = self.rank if rank is None else rank
        n = self.shapes[index][0] if self.shapes[index] else 1
        per = -(-n // self.world_size)
        return min(n, rank * per), min(n, (rank + 1) * per)

    def span(self, index: int, rank: Optional[int] = None) -> tuple[int, int]:
        """The flat elements [start, end) of tensor `index` that `rank` holds: its rows, contiguous."""
        shape = self.shapes[index]
        row = math.prod(shape[1:]) if shape else 1
        start, end = self.rows(index, rank)
        return start * row, end * row

    def padded(self, index: int) -> int:
        """Elements of the largest shard of tensor `index` (collectives move equal sizes)."""
        return max(b - a for a, b in (self.span(index, r) for r in range(self.world_size)))

    def local_shape(self, index: int) -> torch.Size:
        start, end = self.rows(index)
        return torch.Size([end - start, *self.shapes[index][1:]])


def find_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of transformer blocks: UsageError (exit 2) naming the model if it has none to shard by,
    or if a block shares a parameter with the rest of the model (FSDP cannot cut a tied weight in two groups)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)
             and name.rpartition(".")[2] in BLOCK_LISTS and len(m) > 0]
    if not lists:
        raise UsageError(f"inner.parallel fsdp: {type(model).__name__} has no list of transformer blocks to shard "
                         f"(a ModuleList named {' or '.join(BLOCK_LISTS)}); use inner.parallel ddp")
    prefix, blocks = lists[0]
    inside = {id(p) for p in blocks.parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in inside and not name.startswith(prefix + "."):
            raise UsageError(f"inner.parallel fsdp: parameter {name} is tied to a transformer block's: the blocks of "
                             f"{type(model).__name__} cannot be sharded one by one; use inner.parallel ddp")
    return blocks


def shards_model(parallel: str, world_size: int) -> bool:
    """Whether `inner.parallel` over `world_size` ranks shards the model: fsdp over more than one rank."""
    return parallel == "fsdp" and world_size > 1


def shard_model(model: torch.nn.Module) -> None:
    """FSDP2 on `model` in place: each block, then the root. On the meta device (swarm/train/model.py), before
    its weights exist; before an optimizer or a `DiLoCo` is built on its parameters."""
    from torch.distributed.fsdp import fully_shard

    return_freed_memory()
    for block in find_blocks(model):
        fully_shard(block)
    fully_shard(model)


def local_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's rows of each trainable parameter of a sharded model: views of the FSDP shards (what the inner
    optimizer steps), so that writing them moves the model."""
    with torch.no_grad():
        return [p.to_local() for p in model.parameters() if p.requires_grad]


class NodeFile:
    """The whole tensors of `layout`, fp32, one after another in one file that every rank of the peer holds open.
    Rank 0 creates it and removes its name once every rank has it open (a collective), so that nothing is left in
    the folder when the peer ends, however it ends; the bytes live in the page cache meanwhile."""

    def __init__(self, path: Path, layout: Layout, group: Any = None):
        self.layout, self.starts, total = layout, [], 0
        for n in layout.numels:
            self.starts.append(total)
            total += n
        if layout.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(self.fd, 4 * total)
        dist.barrier(group=group)
        if layout.rank != 0:
            self.fd = os.open(path, os.O_RDWR)
        dist.barrier(group=group)
        if layout.rank == 0:
            os.unlink(path)

    def write(self, index: int, start: int, values: torch.Tensor) -> None:
        """Flat elements [start, start + len(values)) of tensor `index` <- `values`."""
        data = memoryview(values.detach().to("cpu", torch.float32).contiguous().numpy()).cast("B")
        at, done = 4 * (self.starts[index] + start), 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], at + done)

    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        """Flat elements [start, end) of tensor `index`, a fresh fp32 CPU tensor."""
        out = torch.empty(end - start, dtype=torch.float32)
        view, at, done = memoryview(out.numpy()).cast("B"), 4 * (self.starts[index] + start), 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], at + done)
            if got == 0:
                raise RuntimeError(f"the exchange file ends before element {start + done // 4} of tensor {index}")
            done += got
        return out

    def _rows(self, index: int) -> Iterator[tuple[int, int, int]]:
        """This rank's rows of tensor `index`, a piece at a time: (file offset, local start, local end)."""
        offset, end = self.layout.span(index)
        for start in range(0, end - offset, Buffers.PIECE):
            yield offset + start, start, min(end - offset, start + Buffers.PIECE)

    def write_rows(self, index: int, read: Callable[[int, int], torch.Tensor]) -> None:
        """This rank's rows of tensor `index` <- `read(start, end)` (flat elements of the rank's shard)."""
        for at, start, end in self._rows(index):
            self.write(index, at, read(start, end))

    @torch.no_grad()
    def read_rows(self, index: int, out: torch.Tensor) -> None:
        """This rank's rows of tensor `index` -> `out`, the rank's shard of it (any device and dtype)."""
        flat = out.view(-1)
        for at, start, end in self._rows(index):
            flat[start:end].copy_(self.read(index, at, at + end - start))

    def vector(self, indices: Sequence[int]) -> NodeVector:
        return NodeVector(self, indices)


class NodeVector(Buffers):
    """Tensors `indices` of a `NodeFile` (a fragment's), as the buffers an average is written into."""

    def __init__(self, file: NodeFile, indices: Sequence[int]):
        self.file, self.indices, self.tensors = file, list(indices), []
        self.shapes = [file.layout.shapes[i] for i in self.indices]

    def write(self, index: int, start: int, values: torch.Tensor) -> None:
        self.file.write(self.indices[index], start, values)

    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        return self.file.read(self.indices[index], start, end)


class Rows(Buffers):
    """This rank's rows of tensors `indices` of a `NodeFile` (shaped `shapes`), read from the file when asked
    (`Buffers.each`: one tensor at a time): what the outer step reads of an average, with no copy of it held
    meanwhile."""

    def __init__(self, file: NodeFile, indices: Sequence[int], shapes: Sequence[torch.Size]):
        self.file, self.indices, self.tensors, self.shapes = file, list(indices), [], list(shapes)

    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        rows = torch.empty(self.shapes[index])
        self.file.read_rows(self.indices[index], rows)
        return rows.view(-1)[start:end]


class Shards:
    """The collectives between the ranks of a sharded peer, over `layout`: one tensor at a time, on the CPU
    (gloo) group of swarm/train/ranks.py; and the exchange's two node-local files in `folder` (`given`: the
    pseudo-gradient, `average`: what the swarm averaged; module docstring)."""

    def __init__(self, layout: Layout, group: Any = None, folder: Optional[Path] = None):
        self.layout, self.group = layout, group
        self.given = NodeFile(folder / "exchange-given.f32", layout, group) if folder is not None else None
        self.average = NodeFile(folder / "exchange-average.f32", layout, group) if folder is not None else None

    @classmethod
    def of(cls, model: torch.nn.Module, rank: int, world_size: int, group: Any, folder: Path) -> Shards:
        """The layout of a model `shard_model` sharded over `world_size` ranks (checked against the shards FSDP
        gave this rank), with the exchange files in `folder`: every rank at once, `group` their CPU process group
        (a collective makes the files)."""
        full = [p for p in model.parameters() if p.requires_grad]
        layout = Layout(tuple(p.shape for p in full), world_size, rank)
        for i, local in enumerate(local_params(model)):
            if local.shape != layout.local_shape(i):
                raise RuntimeError(f"FSDP gave rank {rank} a shard {list(local.shape)} of parameter {i} "
                                   f"{list(full[i].shape)}, expected {list(layout.local_shape(i))}")
        return cls(layout, group, folder)

    @property
    def root(self) -> bool:
        return self.layout.rank == 0

    def gather(self, index: int, local: torch.Tensor) -> Optional[torch.Tensor]:
        """Tensor `index` whole (flat, fp32, CPU) on rank 0 from every rank's `local` rows; None on the others."""
        layout, padded = self.layout, self.layout.padded(index)
        mine = torch.zeros(padded, dtype=torch.float32)
        flat = local.detach().reshape(-1)
        mine[:flat.numel()] = flat.to("cpu", torch.float32)
        if not self.root:
            dist.gather(mine, None, dst=0, group=self.group)
            return None
        buffer = torch.empty(layout.world_size * padded, dtype=torch.float32)
        dist.gather(mine, list(buffer.view(layout.world_size, padded)), dst=0, group=self.group)
        return buffer[:layout.numels[index]]  # shards are padded at the end only (module docstring)

    def scatter(self, index: int, full: Optional[torch.Tensor], out: torch.Tensor) -> None:
        """Every rank's rows of tensor `index` (whole on rank 0, `full`; None elsewhere) into its `out`."""
        layout, padded = self.layout, self.layout.padded(index)
        mine = torch.empty(padded, dtype=torch.float32)
        parts = None
        if self.root:
            buffer = torch.zeros(layout.world_size * padded, dtype=torch.float32)
            buffer[:layout.numels[index]] = full.reshape(-1).to("cpu", torch.float32)
            parts = list(buffer.view(layout.world_size, padded))
        dist.scatter(mine, parts, src=0, group=self.group)
        with torch.no_grad():
            out.view(-1).copy_(mine[:out.numel()].to(out.device, out.dtype))

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank."""
        box = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.group)
        return bool(box.item())

    def sha256(self, tensors: Sequence[torch.Tensor]) -> str:
        """`statehash.tensors_digest` of the whole tensors whose rows `tensors` are (every rank at once): the digest
        an unsharded peer takes of the same values. `tensors` run through the layout's tensors in order, once or
        more (the global parameters, then the outer momentum). Rank 0 holds one whole tensor at a time."""
        digest = hashlib.sha256() if self.root else None
        count = len(self.layout.shapes)
        for i, t in enumerate(tensors):
            whole = self.gather(i % count, t)
            if digest is not None:
                digest.update(tensor_bytes(whole))
        box = [digest.hexdigest() if digest is not None else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
