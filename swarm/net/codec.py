"""How a part of the flat pseudo-gradient travels on the wire.

A `Codec` turns a 1-D fp32 tensor into a hivemind `runtime_pb2.Tensor` message and back. `decode` never
trusts the message: the compression tag, dtype, shape and buffer length are checked against what this
codec produces before a single element is read, so a hostile or confused peer cannot make us allocate
a huge tensor or reinterpret bytes under another codec. The quantized codecs also refuse a non-finite
block scale; NaN/Inf in decoded values are the caller's job (`allreduce.py` checks every decoded part
and every result). Every codec is deterministic: the same input gives the same bytes, and the same
bytes decode to the same floats on every member (the all-reduce relies on this for bit-identical results).

Registry: `get_codec(cfg.compression)`:

| name | wire format (`buffer`)                                              | bytes/elem | rel. error* |
|------|----------------------------------------------------------------------|-----------:|------------:|
| none | fp32                                                                 | 4          | 0           |
| fp16 | fp16 (hivemind's FLOAT16)                                            | 2          | ~3e-4       |
| int8 | fp32 absmax per block of 64, then 1 code byte per element: bitsandbytes' | 1.0625 | ~0.4 %      |
|      | `quantize_blockwise` with its signed *linear* 256-entry map            |            |             |
| int4 | fp32 step per block of 32, then 2 elements per byte (low nibble first):  | 0.625  | ~7 %        |
|      | q in 0..14 stands for (q - 7) * step, step = absmax / 7 (15 uniform levels, 0 exact) |  |   |

*relative L2 error of one round trip on real AdamW pseudo-gradients of configs/tiny.yaml (bench/compression.py).

Measured choices: on real pseudo-gradients (AdamW updates are nearly uniform, not Gaussian) the linear
8-bit map beats bitsandbytes' default dynamic map (0.40 % vs 0.69 % at block 64) and uniform 4-bit levels
beat NF4 (6.8 % vs 8.9 % at block 32; bitsandbytes' own 4-bit CPU kernels are also 5-10x slower than
ours). bitsandbytes is imported lazily, once, on the first int8 use (~2.5 s, a harmless CPU warning).
The int codecs use their own compression tags (outside hivemind's enum), so hivemind's
`deserialize_torch_tensor` refuses them instead of misreading the bytes. A block holding NaN/Inf is sent
with a NaN scale, which every receiver refuses ("scale ... not finite"): quantization never hides a NaN.

hivemind's own 8-bit quantizers are deliberately not used: uniform/quantile 8-bit lose 30-70 % on
heavy-tailed vectors and break under numpy >= 2.4 (see notes/hivemind.md).

Small tensors: `FP32_BELOW`. A lossy codec quantizes only the tensors with at least that many elements;
the averager sends the concatenation of the smaller ones (norms, biases) through a second, fp32
all-reduce in the same group (`split_for_wire` / `join_from_wire`).
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarm.errors import SwarmError

FP32_BELOW = 8192
"""Tensors with fewer elements (norms, biases, scalars) are never quantized: they are a tiny share of
the bytes (the 9 norms of configs/tiny.yaml are 0.14 % of its parameters) and they travel exactly."""


class CodecError(ValueError):
    """A received message does not match what the codec produces (a sender bug or a hostile peer)."""


class Codec(ABC):
    name: str
    compression_type: int  # runtime_pb2.CompressionType value written into every message
    bytes_per_element: float  # an upper bound on buffer bytes per element (the receivers' size limit)
    lossy: bool = True

    @abstractmethod
    def encode(self, t: torch.Tensor) -> runtime_pb2.Tensor:
        """Encode a 1-D fp32 CPU tensor."""

    def decode(self, msg: runtime_pb2.Tensor, numel: Optional[int] = None) -> torch.Tensor:
        """Decode a message made by `encode` into a fresh 1-D fp32 tensor; `numel`: the expected length."""
        self._check_header(msg, numel)
        if len(msg.buffer) != msg.size[0] * self.bytes_per_element:
            raise CodecError(f"buffer of {len(msg.buffer)} bytes does not hold {msg.size[0]} {self.name} elements")
        return deserialize_torch_tensor(msg).to(torch.float32).reshape(-1)

    def round_trip(self, t: torch.Tensor) -> torch.Tensor:
        """What a receiver of `encode(t)` gets."""
        return self.decode(self.encode(t), t.numel())

    def _check_header(self, msg: runtime_pb2.Tensor, numel: Optional[int]) -> None:
        if msg.compression != self.compression_type:
            raise CodecError(f"expected {self.name} payload, got compression type {msg.compression}")
        if msg.dtype != "float32" or len(msg.size) != 1:
            raise CodecError(f"expected a 1-D float32 tensor, got dtype {msg.dtype!r} shape {list(msg.size)}")
        if numel is not None and msg.size[0] != numel:
            raise CodecError(f"expected {numel} elements, got {msg.size[0]}")

    @staticmethod
    def _check_input(t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.float32 or t.dim() != 1:
            raise TypeError(f"codecs take a 1-D float32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
        return t.detach().cpu()


class NoneCodec(Codec):
    """fp32 as is: 4 bytes per element, exact."""

    name, compression_type, bytes_per_element, lossy = "none", runtime_pb2.CompressionType.NONE, 4, False

    def encode(self, t: torch.Tensor) -> runtime_pb2.Tensor:
        return serialize_torch_tensor(self._check_input(t), runtime_pb2.CompressionType.NONE)


class Fp16Codec(Codec):
    """fp16: 2 bytes per element, ~5e-4 relative error; values beyond +-65504 are clamped by hivemind."""

    name, compression_type, bytes_per_element = "fp16", runtime_pb2.CompressionType.FLOAT16, 2

    def encode(self, t: torch.Tensor) -> runtime_pb2.Tensor:
        return serialize_torch_tensor(self._check_input(t), runtime_pb2.CompressionType.FLOAT16)


class _BlockCodec(Codec):
    """Wire layout shared by int8/int4: `[fp32 scale per block][codes]`, both little-endian, no padding
    between; the code bytes of the last block are as many as its elements need."""

    block: int
    bits: int

    def __init__(self):
        self.bytes_per_element = self.bits / 8 + 4 / self.block

    def wire_bytes(self, numel: int) -> int:
        return 4 * math.ceil(numel / self.block) + math.ceil(numel * self.bits / 8)

    def _message(self, numel: int, scales: torch.Tensor, codes: torch.Tensor) -> runtime_pb2.Tensor:
        buffer = scales.to(torch.float32).numpy().tobytes() + codes.numpy().tobytes()
        assert len(buffer) == self.wire_bytes(numel)
        return runtime_pb2.Tensor(buffer=buffer, size=[numel], dtype="float32", requires_grad=False,
                                  compression=self.compression_type)

    def _split(self, msg: runtime_pb2.Tensor, numel: Optional[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Validated (numel, scales, code bytes) of a message; nothing is read before the length is checked."""
        self._check_header(msg, numel)
        n = msg.size[0]
        if len(msg.buffer) != self.wire_bytes(n):
            raise CodecError(f"buffer of {len(msg.buffer)} bytes does not hold {n} {self.name} elements "
                             f"({self.wire_bytes(n)} expected)")
        blocks = math.ceil(n / self.block)
        raw = torch.frombuffer(bytearray(msg.buffer), dtype=torch.uint8) \
            if msg.buffer else torch.empty(0, dtype=torch.uint8)
        scales = raw[: 4 * blocks].view(torch.float32)
        if not torch.isfinite(scales).all() or (scales < 0).any():
            bad = int((~torch.isfinite(scales) | (scales < 0)).nonzero()[0])
            raise CodecError(f"{self.name} scale of block {bad} is {scales[bad].item()}, not finite and >= 0 "
                             f"(the sender's values were NaN/Inf)")
        return n, scales, raw[4 * blocks:]

    def _mark_non_finite(self, t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """NaN scale for every block holding NaN/Inf, so that receivers refuse it (never a silent value)."""
        bad = ~torch.isfinite(t)
        if bad.any():
            scales = scales.clone()
            scales[torch.unique(bad.nonzero().view(-1) // self.block)] = float("nan")
        return scales


_BNB = None
_BNB_LOCK = threading.Lock()


def _bnb_functional():
    """bitsandbytes.functional, imported on first use (~2.5 s and a CPU-kernel warning)."""
    global _BNB
    with _BNB_LOCK:
        if _BNB is None:
            import bitsandbytes.functional as functional

            _BNB = functional
    return _BNB


class Int8Codec(_BlockCodec):
    """bitsandbytes blockwise 8-bit: per block of 64 an fp32 absmax, one byte per element indexing the
    signed linear map (256 levels in [-1, 1]); ~0.4 % relative error on real pseudo-gradients."""

    name, compression_type, block, bits = "int8", 0x5308, 64, 8

    def __init__(self):
        super().__init__()
        self._code = _bnb_functional().create_linear_map(signed=True).to(torch.float32)

    def encode(self, t: torch.Tensor) -> runtime_pb2.Tensor:
        t = self._check_input(t).contiguous()
        if t.numel() == 0:
            return self._message(0, torch.empty(0), torch.empty(0, dtype=torch.uint8))
        codes, state = _bnb_functional().quantize_blockwise(t, code=self._code, blocksize=self.block)
        return self._message(t.numel(), self._mark_non_finite(t, state.absmax.float()), codes.view(-1))

    def decode(self, msg: runtime_pb2.Tensor, numel: Optional[int] = None) -> torch.Tensor:
        n, scales, codes = self._split(msg, numel)
        if n == 0:
            return torch.empty(0)
        return _bnb_functional().dequantize_blockwise(codes, absmax=scales.clone(), code=self._code,
                                                      blocksize=self.block).to(torch.float32).reshape(-1)


class Int4Codec(_BlockCodec):
    """4-bit blockwise absmax: per block of 32 an fp32 step = absmax / 7, each element rounded to the
    nearest of the 15 levels -7..7 times step (0 stays exact), two elements per byte; ~7 % relative
    error on real pseudo-gradients."""

    name, compression_type, block, bits = "int4", 0x5304, 32, 4
    LEVELS = 7

    def encode(self, t: torch.Tensor) -> runtime_pb2.Tensor:
        t = self._check_input(t)
        n, blocks = t.numel(), math.ceil(t.numel() / self.block)
        padded = torch.zeros(blocks * self.block, dtype=torch.float32)
        padded[:n] = t
        rows = padded.view(blocks, self.block)
        steps = rows.abs().amax(dim=1) / self.LEVELS if blocks else torch.empty(0)
        safe = torch.where(torch.isfinite(steps) & (steps > 0), steps, torch.ones_like(steps))
        q = torch.round(rows / safe[:, None]).nan_to_num_(0.0).clamp_(-self.LEVELS, self.LEVELS)
        q = (q + self.LEVELS).to(torch.uint8).view(-1)
        packed = q[0::2] | (q[1::2] << 4)
        return self._message(n, self._mark_non_finite(t, steps), packed[: math.ceil(n / 2)])

    def decode(self, msg: runtime_pb2.Tensor, numel: Optional[int] = None) -> torch.Tensor:
        n, steps, packed = self._split(msg, numel)
        q = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1)[:n]
        if (q > 2 * self.LEVELS).any():
            raise CodecError(f"int4 code {int(q.max())} is out of range 0..{2 * self.LEVELS}")
        values = torch.zeros(steps.numel() * self.block, dtype=torch.float32)
        values[:n] = q
        values = values.sub_(self.LEVELS).view(-1, self.block).mul_(steps[:, None]).view(-1)
        return values[:n].clone() if n % self.block else values


_CODECS: dict[str, type[Codec]] = {"none": NoneCodec, "fp16": Fp16Codec, "int8": Int8Codec, "int4": Int4Codec}


def get_codec(name: str) -> Codec:
    """The codec for `SwarmConfig.compression`."""
    if name in _CODECS:
        return _CODECS[name]()
    raise SwarmError(f"unknown compression {name!r}: expected one of {sorted(_CODECS)}")


# ---- which tensors are quantized --------------------------------------------------------------------

def quantized_mask(shapes: Sequence[torch.Size], codec: Codec) -> list[bool]:
    """Per tensor: True if it travels through `codec`, False if it travels in fp32 (lossless codecs: all)."""
    return [not codec.lossy or math.prod(shape) >= FP32_BELOW for shape in shapes]


def split_for_wire(tensors: Sequence[torch.Tensor], mask: Sequence[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat fp32 vector of the tensors to quantize, flat fp32 vector of the others), each in tensor order."""
    def flat(keep: bool) -> torch.Tensor:
        parts = [t.detach().reshape(-1).to("cpu", torch.float32) for t, m in zip(tensors, mask) if m == keep]
        return torch.cat(parts) if parts else torch.empty(0)
    return flat(True), flat(False)


def join_from_wire(quantized: torch.Tensor, exact: torch.Tensor, shapes: Sequence[torch.Size],
                   mask: Sequence[bool]) -> list[torch.Tensor]:
    """The inverse of `split_for_wire`: fresh tensors of `shapes`."""
    sources, offsets, out = {True: quantized, False: exact}, {True: 0, False: 0}, []
    for shape, m in zip(shapes, mask):
        n = math.prod(shape)
        out.append(sources[m][offsets[m]: offsets[m] + n].view(shape).clone())
        offsets[m] += n
    return out


def part_residual(codec: Codec, flat: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """flat minus what the all-reduce's owners receive of it (each part [s, e) is encoded on its own):
    the part of this peer's contribution lost to quantization (zero for lossless codecs)."""
    if not codec.lossy:
        return torch.zeros_like(flat)
    return flat - torch.cat([codec.round_trip(flat[s:e]) for s, e in bounds] or [torch.empty(0)])
