"""Where every element of the pseudo-gradient goes on the wire, computed alike by every member.

The pseudo-gradient is never flattened into one vector. The *wire vector* is a virtual concatenation of
the model's tensors: first the tensors the codec quantizes (in model order), then the small ones that
always travel in fp32 (`codec.FP32_BELOW`; none for a lossless codec). It is cut into contiguous parts, one
per *owner*, in member order: every member but the clients (`swarm.client_mode`: peers that cannot be
dialed, e.g. behind a NAT) owns one; a client's part is empty, so nobody ever opens a stream to it (it
pushes its contributions to the owners and takes the averages back on the streams it opened). Every part
is cut into chunks of at most `budget.CHUNK_ELEMENTS`, cut again where the quantized region ends. A chunk is the
unit of everything that moves: read from the model's tensors, encoded, sent, reduced, sent back, decoded
and written into the output tensors, one chunk at a time.

Chunks start at their part's start and are multiples of every codec's block (64, 32), so encoding a part
chunk by chunk gives the same bytes as encoding it whole.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch

from swarm.net.budget import CHUNK_ELEMENTS
from swarm.net.codec import EXACT, FP32_BELOW, Codec, CodecError
from swarm.tensors import Buffers, all_finite


def part_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """n contiguous [start, end) ranges covering numel elements, sizes differing by at most one."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for j in range(n):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class Span:
    """Elements [start, end) of the flattened model tensor `tensor`."""

    tensor: int
    start: int
    end: int


@dataclass(frozen=True)
class Chunk:
    """Elements [start, end) of the wire vector; `exact`: they travel in fp32 whatever the codec."""

    index: int  # position within its part
    start: int
    end: int
    exact: bool
    spans: tuple[Span, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


class WireLayout:
    def __init__(self, shapes: Sequence[torch.Size], codec: Codec, members: int,
                 chunk_elements: int = CHUNK_ELEMENTS, clients: Collection[int] = ()):
        """`clients`: the indices of the members that own no part (they cannot be dialed)."""
        self.clients = frozenset(clients)
        if not self.clients <= set(range(members)):
            raise ValueError(f"clients {sorted(self.clients)} are not all among {members} members")
        self.owners = [j for j in range(members) if j not in self.clients]
        if not self.owners:
            raise ValueError(f"all {members} members are clients: nobody can own a part")
        sizes = [math.prod(s) for s in shapes]
        quantized = [not codec.lossy or n >= FP32_BELOW for n in sizes]
        self.order = [i for i in range(len(sizes)) if quantized[i]] + [i for i in range(len(sizes)) if not quantized[i]]
        self.codec, self.members, self.chunk_elements = codec, members, chunk_elements
        self._starts, start = [], 0  # wire offset of each tensor in `order`
        for i in self.order:
            self._starts.append(start)
            start += sizes[i]
        self._sizes = [sizes[i] for i in self.order]
        self.numel = start
        self.exact_from = sum(n for n, q in zip(sizes, quantized) if q)  # where the fp32 region starts
        cut = iter(part_bounds(self.numel, len(self.owners)))
        self.parts = [(self.numel, self.numel) if j in self.clients else next(cut) for j in range(members)]

    def codec_of(self, chunk: Chunk) -> Codec:
        return EXACT if chunk.exact else self.codec

    def chunks(self, part: int) -> list[Chunk]:
        start, end = self.parts[part]
        cuts = sorted({start, end, *range(start, end, self.chunk_elements),
                       *([self.exact_from] if start < self.exact_from < end else [])})
        return [Chunk(k, a, b, a >= self.exact_from, self._spans(a, b)) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]

    def _spans(self, a: int, b: int) -> tuple[Span, ...]:
        spans, k = [], bisect.bisect_right(self._starts, a) - 1
        while a < b:
            while self._sizes[k] == 0 or a >= self._starts[k] + self._sizes[k]:
                k += 1
            stop = min(b, self._starts[k] + self._sizes[k])
            spans.append(Span(self.order[k], a - self._starts[k], stop - self._starts[k]))
            a = stop
        return tuple(spans)

    def part_wire_bytes(self, part: int) -> int:
        """Encoded bytes of one member's contribution to `part` (and of the part's result)."""
        return sum(self.codec_of(c).wire_bytes(c.numel) for c in self.chunks(part))

    def member_wire_bytes(self, me: int) -> int:
        """Bytes member `me` sends in one all-reduce, and receives (the same): its contributions to the other
        parts, and its own part's result to the n-1 others (a client owns nothing: its part is empty)."""
        others = sum(self.part_wire_bytes(j) for j in range(self.members) if j != me)
        return others + (self.members - 1) * self.part_wire_bytes(me)


def gather(read: Callable[[int, int, int], torch.Tensor], chunk: Chunk) -> torch.Tensor:
    """A chunk's elements as one fp32 CPU tensor; `read(tensor, start, end)` gives one span's elements."""
    pieces = [read(s.tensor, s.start, s.end) for s in chunk.spans]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def scatter(out: Sequence[torch.Tensor] | Buffers, chunk: Chunk, values: torch.Tensor) -> None:
    """Write a chunk's elements into `out` (tensors, in place, of any device and dtype; or buffers)."""
    out, offset = Buffers.of(out), 0
    for s in chunk.spans:
        n = s.end - s.start
        out.write(s.tensor, s.start, values[offset:offset + n])
        offset += n


def decode_into(out: Sequence[torch.Tensor] | Buffers, chunk: Chunk, codec: Codec, payload: bytes | bytearray) -> None:
    """Decode an average of `chunk` into `out`; CodecError if it is not finite (nothing is written then)."""
    values = codec.decode(payload, chunk.numel)
    if not all_finite(values):
        raise CodecError("the average is not finite")
    scatter(out, chunk, values)
