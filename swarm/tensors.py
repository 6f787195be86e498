"""Small tensor helpers shared by the trainer, the checkpoint and the network code."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional, Sequence

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in `t`: one pass and no allocation (torch.isfinite(t).all() writes a bool per element,
    11x slower on 50M floats); NaN propagates through min/max."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t.detach())
    return bool(torch.isfinite(low) and torch.isfinite(high))


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a state or checkpoint names ("float32", "bfloat16", ...); ValueError for any other."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one a state may hold")
    return _DTYPES[name]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (any device), for writing received bytes in place."""
    return t.detach().reshape(-1).view(torch.uint8)


@contextlib.contextmanager
def swapped(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Iterator[None]:
    """`a[i]` and `b[i]` exchange their values for the body, and back after it (also when it raises): exact, and
    with one tensor's copy at a time beside them, where setting one aside whole would copy all of `a`. Pairs
    must have one dtype and shape (a swap across dtypes would round); their devices may differ."""
    for x, y in zip(a, b, strict=True):
        if x.dtype != y.dtype or x.shape != y.shape:
            raise ValueError(f"cannot swap a {x.dtype} {tuple(x.shape)} tensor with a {y.dtype} {tuple(y.shape)} one")

    def swap(x: torch.Tensor, y: torch.Tensor) -> None:
        held = x.detach().clone()
        x.detach().copy_(y.detach())
        y.detach().copy_(held)

    done = 0
    try:
        with torch.no_grad():
            for x, y in zip(a, b):
                swap(x, y)
                done += 1
        yield
    finally:
        with torch.no_grad():
            for x, y in zip(a[:done], b[:done]):
                swap(x, y)


class Buffers:
    """fp32 vectors by tensor index, written and read by flat element span: where an average lands. In memory (the
    tensors given), or a sharded peer's node-local file (swarm/train/sharding.py `NodeVector`), so that a writer that
    goes chunk by chunk (the all-reduce) never needs the whole vector in one process."""

    PIECE = 1 << 22  # elements copied at a time by `fill`

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)
        self.shapes = [t.shape for t in self.tensors]

    @classmethod
    def of(cls, out: Sequence[torch.Tensor] | Buffers) -> Buffers:
        return out if isinstance(out, Buffers) else cls(out)

    def numel(self, index: int) -> int:
        return math.prod(self.shapes[index])

    def write(self, index: int, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + len(values)) of tensor `index` <- `values`."""
        self.tensors[index].detach().view(-1)[start:start + values.numel()].copy_(values)

    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of tensor `index`, as fp32 on the CPU."""
        return self.tensors[index].detach().view(-1)[start:end].float().cpu()

    def restart(self) -> None:
        """An all-reduce begins writing: forget what an earlier try left (here nothing: it writes every element)."""

    def each(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(index, tensor) for every tensor, shaped: what an outer step reads, one tensor at a time."""
        for i, shape in enumerate(self.shapes):
            yield i, self.tensors[i] if self.tensors else self.read(i, 0, self.numel(i)).view(shape)

    def fill(self, read: Callable[[int, int, int], torch.Tensor]) -> None:
        """Every tensor <- `read(index, start, end)` (a pseudo-gradient's), a piece at a time."""
        for i in range(len(self.shapes)):
            n = self.numel(i)
            for start in range(0, n, self.PIECE):
                self.write(i, start, read(i, start, min(n, start + self.PIECE)))


class Deferred(Buffers):
    """Buffers that copy nothing: `fill` remembers what to read, and `each` reads it one tensor at a time. For an
    average that is a peer's own pseudo-gradient (alone, no network), which stays as it is until the outer step
    reads it (kept by a delayed exchange; a blocking one lands at once, each tensor read before it is stepped)."""

    def __init__(self, shapes: Sequence[torch.Size]):
        self.shapes, self.tensors = list(shapes), []
        self._read: Optional[Callable[[int, int, int], torch.Tensor]] = None

    def fill(self, read: Callable[[int, int, int], torch.Tensor]) -> None:
        self._read = read

    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        if self._read is None:
            raise ValueError("nothing was given to read")
        return self._read(index, start, end)

    def write(self, index: int, start: int, values: torch.Tensor) -> None:
        raise TypeError("Deferred buffers read what `fill` gave, they hold nothing")
