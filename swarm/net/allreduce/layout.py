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
from typing import Callable, Collection, Iterator, Sequence

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
    """Decode an average of `chunk` into `out` (an `EncodedAverage` keeps its bytes instead); CodecError if it is
    not finite (nothing is written then)."""
    if isinstance(out, EncodedAverage):
        codec.check(payload, chunk.numel)  # a wrong length or a non-finite value: CodecError, each saying which
        out.keep(chunk, codec, payload)
        return
    values = codec.decode(payload, chunk.numel)
    if not all_finite(values):
        raise CodecError("the average is not finite")
    scatter(out, chunk, values)


class EncodedAverage(Buffers):
    """An average as the wire carried it: each chunk's bytes (int8: 1.0625 per element), checked on arrival and
    decoded only when read, one tensor at a time (`each`: the outer step). Decoded into fp32 buffers on arrival,
    an average takes 4 bytes per parameter for as long as its exchange is in flight, which with `diloco.delay`
    spans the next round's first inner steps. The bytes are those every member of the group decodes, so what
    `each` gives is the same floats, bit for bit, as decoding on arrival."""

    def __init__(self, shapes: Sequence[torch.Size]):
        self.shapes, self.tensors = [torch.Size(s) for s in shapes], []
        self._kept: dict[int, tuple[Chunk, Codec, bytes | bytearray]] = {}  # by the chunk's start on the wire
        self._held = [0] * len(self.shapes)  # elements of each tensor the kept chunks cover

    @property
    def nbytes(self) -> int:
        """The encoded bytes held."""
        return sum(len(payload) for _, _, payload in self._kept.values())

    def restart(self) -> None:
        self._kept.clear()
        self._held = [0] * len(self.shapes)

    def keep(self, chunk: Chunk, codec: Codec, payload: bytes | bytearray) -> None:
        """`chunk`'s average, in `codec`'s bytes (already checked: `Codec.check`)."""
        if chunk.start in self._kept:
            raise ValueError(f"the average of wire elements from {chunk.start} arrived twice")
        self._kept[chunk.start] = (chunk, codec, payload)
        for s in chunk.spans:
            self._held[s.tensor] += s.end - s.start

    def write(self, index: int, start: int, values: torch.Tensor) -> None:
        raise TypeError("an EncodedAverage keeps encoded chunks (decode_into, fill), not values")

    def fill(self, read: Callable[[int, int, int], torch.Tensor]) -> None:
        """Every tensor <- `read(index, start, end)`, kept exact (fp32 bytes): a peer alone, its own pseudo-gradient."""
        self.restart()
        offset = 0
        for i in range(len(self.shapes)):
            n = self.numel(i)
            for a in range(0, n, self.PIECE):
                b = min(n, a + self.PIECE)
                self.keep(Chunk(0, offset + a, offset + b, True, (Span(i, a, b),)), EXACT, EXACT.encode(read(i, a, b)))
            offset += n

    def read(self, index: int, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of tensor `index` (a groupmate's repair), decoded from the chunks that hold them."""
        out = torch.empty(end - start)
        for chunk, codec, payload in self._kept.values():
            offset = 0
            for s in chunk.spans:
                lo, hi = max(s.start, start), min(s.end, end)
                if s.tensor == index and lo < hi:
                    values = codec.decode(payload, chunk.numel)
                    out[lo - start:hi - start] = values[offset + lo - s.start:offset + hi - s.start]
                offset += s.end - s.start
        return out

    def each(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Every tensor of the average in fp32, in wire order, each chunk decoded once; ValueError before the
        first if any tensor is not wholly held (a caller that changes state per tensor never half-applies)."""
        short = [i for i, held in enumerate(self._held) if held != self.numel(i)]
        if short:
            raise ValueError(f"the average of tensors {short[:8]} is incomplete")
        filling: dict[int, torch.Tensor] = {}
        for start in sorted(self._kept):
            chunk, codec, payload = self._kept[start]
            values, offset = codec.decode(payload, chunk.numel), 0
            for s in chunk.spans:
                t = filling.setdefault(s.tensor, torch.empty(self.numel(s.tensor)))
                t[s.start:s.end] = values[offset:offset + s.end - s.start]
                offset += s.end - s.start
                if s.end == t.numel():
                    yield s.tensor, filling.pop(s.tensor).view(self.shapes[s.tensor])
        for i in range(len(self.shapes)):
            if self.numel(i) == 0:
                yield i, torch.empty(self.shapes[i])
