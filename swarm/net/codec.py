"""How a part of the flat pseudo-gradient travels on the wire.

A `Codec` turns a 1-D fp32 tensor into a hivemind `runtime_pb2.Tensor` message and back. `decode` never
trusts the message: the compression tag, dtype, shape and buffer length are checked against what this
codec produces before a single element is read, so a hostile or confused peer cannot make us allocate
a huge tensor or reinterpret bytes under another codec. NaN/Inf checks are the caller's job
(`allreduce.py` checks every decoded part and every result).

Registry: `get_codec(cfg.compression)`. "none" (fp32) and "fp16" exist; "int8"/"int4" raise until they
are implemented. hivemind's own 8-bit quantizers are deliberately not used: uniform/quantile 8-bit lose
30-70 % on heavy-tailed vectors and break under numpy >= 2.4 (see notes/hivemind.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from swarm.errors import SwarmError


class CodecError(ValueError):
    """A received message does not match what the codec produces (a sender bug or a hostile peer)."""


class Codec(ABC):
    name: str
    compression_type: int  # runtime_pb2.CompressionType value written into every message
    bytes_per_element: int

    @abstractmethod
    def encode(self, t: torch.Tensor) -> runtime_pb2.Tensor:
        """Encode a 1-D fp32 CPU tensor."""

    def decode(self, msg: runtime_pb2.Tensor, numel: Optional[int] = None) -> torch.Tensor:
        """Decode a message made by `encode` into a fresh 1-D fp32 tensor; `numel`: the expected length."""
        if msg.compression != self.compression_type:
            raise CodecError(f"expected {self.name} payload, got compression type {msg.compression}")
        if msg.dtype != "float32" or len(msg.size) != 1:
            raise CodecError(f"expected a 1-D float32 tensor, got dtype {msg.dtype!r} shape {list(msg.size)}")
        if numel is not None and msg.size[0] != numel:
            raise CodecError(f"expected {numel} elements, got {msg.size[0]}")
        if len(msg.buffer) != msg.size[0] * self.bytes_per_element:
            raise CodecError(f"buffer of {len(msg.buffer)} bytes does not hold {msg.size[0]} {self.name} elements")
        return deserialize_torch_tensor(msg).to(torch.float32).reshape(-1)

    @staticmethod
    def _check_input(t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.float32 or t.dim() != 1:
            raise TypeError(f"codecs take a 1-D float32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
        return t.detach().cpu()


class NoneCodec(Codec):
    """fp32 as is: 4 bytes per element, exact."""

    name, compression_type, bytes_per_element = "none", runtime_pb2.CompressionType.NONE, 4

    def encode(self, t: torch.Tensor) -> runtime_pb2.Tensor:
        return serialize_torch_tensor(self._check_input(t), runtime_pb2.CompressionType.NONE)


class Fp16Codec(Codec):
    """fp16: 2 bytes per element, ~5e-4 relative error; values beyond +-65504 are clamped by hivemind."""

    name, compression_type, bytes_per_element = "fp16", runtime_pb2.CompressionType.FLOAT16, 2

    def encode(self, t: torch.Tensor) -> runtime_pb2.Tensor:
        return serialize_torch_tensor(self._check_input(t), runtime_pb2.CompressionType.FLOAT16)


_CODECS: dict[str, type[Codec]] = {"none": NoneCodec, "fp16": Fp16Codec}
_PLANNED = ("int8", "int4")


def get_codec(name: str) -> Codec:
    """The codec for `SwarmConfig.compression`."""
    if name in _CODECS:
        return _CODECS[name]()
    if name in _PLANNED:
        raise SwarmError(f"compression {name!r} is not implemented yet: use 'none' or 'fp16'")
    raise SwarmError(f"unknown compression {name!r}: expected one of {sorted(_CODECS) + list(_PLANNED)}")
