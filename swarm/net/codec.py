"""How a run of the pseudo-gradient travels on the wire: a `Codec` turns a 1-D fp32 tensor into bytes and back.

`decode` never trusts its input: the byte length must be exactly `wire_bytes(numel)` for the element count
the receiver expects (it knows it from the wire layout, never from the sender), and a quantized payload's
block scales must be finite and >= 0, before a single element is read. So a hostile or confused peer cannot
make us allocate more than the chunk we asked for, nor hide a NaN. NaN/Inf in decoded values are the
caller's job (`allreduce/allreduce.py` checks every decoded chunk and every result). Every codec is deterministic: the
same input gives the same bytes, and the same bytes decode to the same floats on every member (the
all-reduce relies on this for bit-identical results).

Registry: `get_codec(cfg.compression)`:

| name | wire format                                                          | bytes/elem | rel. error* |
|------|----------------------------------------------------------------------|-----------:|------------:|
| none | fp32, little-endian                                                  | 4          | 0           |
| fp16 | fp16 (values beyond +-65504 clamped)                                 | 2          | ~3e-4       |
| int8 | fp32 absmax per block of 64, then 1 code byte per element: bitsandbytes' | 1.0625 | ~0.4 %      |
|      | `quantize_blockwise` with its signed *linear* 256-entry map            |            |             |
| int4 | fp32 step per block of 32, then 2 elements per byte (low nibble first):  | 0.625  | ~7 %        |
|      | q in 0..14 stands for (q - 7) * step, step = absmax / 7 (15 uniform levels, 0 exact) |  |   |

*relative L2 error of one round trip on real AdamW pseudo-gradients of configs/tiny.yaml (bench/compression.py).

Measured choices: on real pseudo-gradients (AdamW updates are nearly uniform, not Gaussian) the linear
8-bit map beats bitsandbytes' default dynamic map (0.40 % vs 0.69 % at block 64) and uniform 4-bit levels
beat NF4 (6.8 % vs 8.9 % at block 32; bitsandbytes' own 4-bit CPU kernels are also 5-10x slower than
ours). bitsandbytes is imported lazily, once, on the first int8 use (~2.5 s, a harmless CPU warning).
A block holding NaN/Inf is sent with a NaN scale, which every receiver refuses ("scale ... not finite"):
quantization never hides a NaN. hivemind's own 8-bit quantizers are deliberately not used: uniform/quantile
8-bit lose 30-70 % on heavy-tailed vectors and break under numpy >= 2.4 (see notes/hivemind.md).

Small tensors: `FP32_BELOW`. A lossy codec quantizes only the tensors with at least that many elements;
the wire layout (`allreduce/layout.py`) sends the smaller ones (norms, biases) in fp32, after the quantized ones.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod

import torch

from swarm.errors import SwarmError
from swarm.tensors import all_finite

FP32_BELOW = 8192
"""Tensors with fewer elements (norms, biases, scalars) are never quantized: they are a tiny share of
the bytes (the 9 norms of configs/tiny.yaml are 0.14 % of its parameters) and they travel exactly."""


class CodecError(ValueError):
    """Received bytes do not match what the codec produces (a sender bug or a hostile peer)."""


class Codec(ABC):
    name: str
    lossy: bool = True

    @abstractmethod
    def wire_bytes(self, numel: int) -> int:
        """The exact encoded length of `numel` elements."""

    @abstractmethod
    def encode(self, t: torch.Tensor) -> bytes:
        """Encode a 1-D fp32 CPU tensor."""

    @abstractmethod
    def _decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """`raw`: the payload as uint8, its length already checked."""

    def decode(self, buf: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """A 1-D fp32 tensor of `numel` elements from bytes made by `encode`; CodecError otherwise.
        A `bytearray` is used in place (the fp32 result may share its memory); other buffers are copied."""
        raw = self._raw(buf, numel)
        return self._decode(raw, numel) if numel else torch.empty(0)

    def check(self, buf: bytes | bytearray | memoryview, numel: int) -> None:
        """CodecError unless `buf` decodes to `numel` finite elements (bytes kept to be decoded later:
        allreduce/layout.py `EncodedAverage`)."""
        if not all_finite(self.decode(buf, numel)):
            raise CodecError("the average is not finite")

    def _raw(self, buf: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """The payload as uint8, once its length is the one `numel` elements take."""
        if len(buf) != self.wire_bytes(numel):
            raise CodecError(f"{len(buf)} bytes do not hold {numel} {self.name} elements "
                             f"({self.wire_bytes(numel)} expected)")
        if numel == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(buf if isinstance(buf, bytearray) else bytearray(buf), dtype=torch.uint8)

    def round_trip(self, t: torch.Tensor) -> torch.Tensor:
        """What a receiver of `encode(t)` gets."""
        return self.decode(self.encode(t), t.numel())

    @staticmethod
    def _check_input(t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.float32 or t.dim() != 1:
            raise TypeError(f"codecs take a 1-D float32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
        return t.detach().cpu().contiguous()


class NoneCodec(Codec):
    """fp32 as is: 4 bytes per element, exact."""

    name, lossy = "none", False

    def wire_bytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, t: torch.Tensor) -> bytes:
        return self._check_input(t).numpy().tobytes()

    def _decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        return raw.view(torch.float32)


class Fp16Codec(Codec):
    """fp16: 2 bytes per element, ~5e-4 relative error; values beyond +-65504 are clamped (NaN stays NaN)."""

    name = "fp16"

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, t: torch.Tensor) -> bytes:
        return self._check_input(t).clamp(-65504.0, 65504.0).to(torch.float16).numpy().tobytes()

    def _decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        return raw.view(torch.float16).to(torch.float32)


class _BlockCodec(Codec):
    """Wire layout shared by int8/int4: `[fp32 scale per block][codes]`, both little-endian, no padding
    between; the code bytes of the last block are as many as its elements need."""

    block: int
    bits: int

    def wire_bytes(self, numel: int) -> int:
        return 4 * math.ceil(numel / self.block) + math.ceil(numel * self.bits / 8)

    def _pack(self, numel: int, scales: torch.Tensor, codes: torch.Tensor) -> bytes:
        buffer = scales.to(torch.float32).numpy().tobytes() + codes.numpy().tobytes()
        assert len(buffer) == self.wire_bytes(numel)
        return buffer

    def _split(self, raw: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, code bytes) of a payload; refuses negative or non-finite scales."""
        blocks = math.ceil(numel / self.block)
        scales = raw[: 4 * blocks].view(torch.float32)
        bad = ~torch.isfinite(scales) | (scales < 0)
        if bad.any():
            first = int(bad.nonzero()[0])
            raise CodecError(f"{self.name} scale of block {first} is {scales[first].item()}, not finite and >= 0 "
                             f"(the sender's values were NaN/Inf)")
        return scales, raw[4 * blocks:]

    def _mark_non_finite(self, t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """NaN scale for every block holding NaN/Inf, so that receivers refuse it (never a silent value)."""
        if all_finite(t):
            return scales
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

    name, block, bits = "int8", 64, 8

    _map = None

    @property
    def _code(self) -> torch.Tensor:
        """The signed linear map, made on first use (an int8 codec that only counts bytes imports nothing)."""
        if Int8Codec._map is None:
            Int8Codec._map = _bnb_functional().create_linear_map(signed=True).to(torch.float32)
        return Int8Codec._map

    def encode(self, t: torch.Tensor) -> bytes:
        t = self._check_input(t)
        if t.numel() == 0:
            return b""
        codes, state = _bnb_functional().quantize_blockwise(t, code=self._code, blocksize=self.block)
        return self._pack(t.numel(), self._mark_non_finite(t, state.absmax.float()), codes.view(-1))

    def check(self, buf: bytes | bytearray | memoryview, numel: int) -> None:
        """Finite scales make finite values (every code stands for a level in [-1, 1]): nothing to decode."""
        raw = self._raw(buf, numel)
        if numel:
            self._split(raw, numel)

    def _decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        scales, codes = self._split(raw, numel)
        return _bnb_functional().dequantize_blockwise(codes, absmax=scales.clone(), code=self._code,
                                                      blocksize=self.block).to(torch.float32).reshape(-1)


class Int4Codec(_BlockCodec):
    """4-bit blockwise absmax: per block of 32 an fp32 step = absmax / 7, each element rounded to the
    nearest of the 15 levels -7..7 times step (0 stays exact), two elements per byte; ~7 % relative
    error on real pseudo-gradients."""

    name, block, bits = "int4", 32, 4
    LEVELS = 7

    def encode(self, t: torch.Tensor) -> bytes:
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
        return self._pack(n, self._mark_non_finite(t, steps), packed[: math.ceil(n / 2)])

    def _decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        steps, packed = self._split(raw, numel)
        q = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1)[:numel]
        if (q > 2 * self.LEVELS).any():
            raise CodecError(f"int4 code {int(q.max())} is out of range 0..{2 * self.LEVELS}")
        values = torch.zeros(steps.numel() * self.block, dtype=torch.float32)
        values[:numel] = q
        values = values.sub_(self.LEVELS).view(-1, self.block).mul_(steps[:, None]).view(-1)
        return values[:numel].clone() if numel % self.block else values


_CODECS: dict[str, type[Codec]] = {"none": NoneCodec, "fp16": Fp16Codec, "int8": Int8Codec, "int4": Int4Codec}
EXACT = NoneCodec()


def kept_dtype(name: str) -> torch.dtype:
    """What a pseudo-gradient kept through a delayed exchange is stored in (swarm/train/overlap.py): fp16 where
    compression `name` rounds it to fp16 or coarser on the wire anyway, else fp32."""
    return torch.float16 if name in _CODECS and _CODECS[name].lossy else torch.float32


def get_codec(name: str) -> Codec:
    """The codec for `SwarmConfig.compression`."""
    if name in _CODECS:
        return _CODECS[name]()
    raise SwarmError(f"unknown compression {name!r}: expected one of {sorted(_CODECS)}")
