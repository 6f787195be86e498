"""Frames over raw libp2p streams: bounded memory whatever the peer sends, and waits that end.

hivemind's protobuf streams read a whole message of whatever length the peer announces before anyone can
check it. Here every stream is a `Channel` of frames `[kind: u8][length: u32 LE][payload]`, and the reader
names the largest payload it accepts before a byte of it is read: a peer that announces more is refused
(`ProtocolError`), never buffered. Payloads are read straight into one buffer of the announced size.

Time-outs follow progress, not the whole operation:
- `stall`: a read or write that moves no byte for this long raises `Stalled`. Raise
  `swarm.stall_timeout` if you see "stalled" on a link that is slow but alive; lower it if a dead peer
  holds a round up for too long.
- The floor on bandwidth (`swarm.min_bandwidth`) is enforced by the caller around a whole transfer
  (`budget.transfer_deadline`), since only it knows how many bytes the transfer has to move.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Awaitable, Callable

from hivemind.p2p import P2P, PeerID
from hivemind.utils.serializer import MSGPackSerializer

from swarm.errors import SwarmError

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<BI")
PIECE = 2**16  # writes are drained, and reads taken, at most this many bytes at a time
CONTROL_BYTES = 2**22  # the largest control payload (hello, request, manifest) anyone accepts


class Kind(IntEnum):
    HELLO = 1  # msgpack dict: who we are, which group or state we want
    CHUNK = 2  # encoded chunk of a contribution
    RESULT = 3  # encoded chunk of a part's average
    DONE = 4  # the sender holds the whole average: it will ask for nothing more
    FAIL = 5  # utf-8 reason: the sender gives up on this stream
    MANIFEST = 6  # msgpack dict describing the state that follows
    DATA = 7  # bytes of a state tensor


class WireError(SwarmError):
    """A stream ended, stalled or carried something it should not."""


class Stalled(WireError):
    pass


class Closed(WireError):
    pass


class ProtocolError(WireError):
    """The peer sent something no honest peer sends (too large, wrong kind, malformed)."""


class PeerFailed(WireError):
    """The peer sent a FAIL frame with its reason."""


@dataclass
class Traffic:
    """Payload and header bytes moved, shared by the channels of one operation."""

    sent: int = 0
    received: int = 0


class Channel:
    """One raw stream to `peer`: framed sends and receives, each bounded by `stall` seconds without progress."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: PeerID, stall: float,
                 traffic: Traffic | None = None):
        self.reader, self.writer, self.peer, self.stall = reader, writer, peer, stall
        self.traffic = traffic or Traffic()

    def count_into(self, traffic: Traffic) -> None:
        """From now on count this channel's bytes (and those so far) in `traffic`."""
        traffic.sent += self.traffic.sent
        traffic.received += self.traffic.received
        self.traffic = traffic

    @classmethod
    async def open(cls, p2p: P2P, peer: PeerID, handler: str, stall: float, traffic: Traffic | None = None) -> Channel:
        try:
            async with asyncio.timeout(stall):
                _, reader, writer = await p2p.call_binary_stream_handler(peer, handler)
        except TimeoutError:
            raise Stalled(f"no stream to {peer} within {stall:g} s (swarm.stall_timeout)") from None
        except Exception as e:  # P2PDaemonError, ConnectionError: the peer is gone or refuses
            raise Closed(f"cannot open a stream to {peer}: {e}") from e
        return cls(reader, writer, peer, stall, traffic)

    async def recv(self, max_bytes: int) -> tuple[Kind, bytearray]:
        """The next frame; refuses (ProtocolError) a payload announced larger than `max_bytes`."""
        kind, length = HEADER.unpack(await self._read(HEADER.size))
        if kind not in Kind._value2member_map_:
            raise ProtocolError(f"{self.peer} sent a frame of unknown kind {kind}")
        if length > max_bytes:
            raise ProtocolError(f"{self.peer} announced {length} bytes where at most {max_bytes} fit")
        payload = await self._read(length)
        if kind == Kind.FAIL:
            raise PeerFailed(f"{self.peer}: {payload[:500].decode(errors='replace')}")
        return Kind(kind), payload

    async def recv_kind(self, expected: Kind, max_bytes: int) -> bytearray:
        kind, payload = await self.recv(max_bytes)
        if kind != expected:
            raise ProtocolError(f"{self.peer} sent {kind.name} where {expected.name} was due")
        return payload

    async def recv_control(self) -> dict[str, Any]:
        """A HELLO or MANIFEST payload: a msgpack dict, or ProtocolError."""
        kind, payload = await self.recv(CONTROL_BYTES)
        if kind not in (Kind.HELLO, Kind.MANIFEST):
            raise ProtocolError(f"{self.peer} sent {kind.name} where a control frame was due")
        try:
            value = MSGPackSerializer.loads(bytes(payload))
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise ProtocolError(f"{self.peer} sent an unreadable {kind.name}: {e!r}") from None
        if not isinstance(value, dict):
            raise ProtocolError(f"{self.peer} sent a {kind.name} that is not a mapping")
        return value

    async def send(self, kind: Kind, payload: bytes | bytearray | memoryview = b"") -> None:
        view = memoryview(payload).cast("B")
        try:
            async with asyncio.timeout(self.stall) as watchdog:
                self.writer.write(HEADER.pack(kind, len(view)))
                for offset in range(0, max(len(view), 1), PIECE):
                    self.writer.write(view[offset:offset + PIECE])
                    await self.writer.drain()
                    watchdog.reschedule(asyncio.get_running_loop().time() + self.stall)
        except TimeoutError:
            raise Stalled(f"{self.peer} took no byte for {self.stall:g} s (swarm.stall_timeout)") from None
        except (ConnectionError, RuntimeError) as e:  # RuntimeError: "unable to perform operation on closed ..."
            raise Closed(f"stream to {self.peer} closed: {e}") from None
        self.traffic.sent += HEADER.size + len(view)

    async def send_control(self, kind: Kind, value: dict[str, Any]) -> None:
        await self.send(kind, MSGPackSerializer.dumps(value))

    async def fail(self, reason: str) -> None:
        """Tell the peer why we give up, if it still listens; never raises."""
        try:
            await asyncio.wait_for(self.send(Kind.FAIL, reason.encode()[:500]), min(self.stall, 5.0))
        except (WireError, TimeoutError):
            pass

    async def refuse(self, reason: str) -> None:
        """`fail`, then wait (at most min(stall, 5) s) for the peer to close, discarding what it still sends.
        For a handler that turns a stream away, with no other task reading it: closing at once resets the
        stream when bytes the peer wrote before reading our FAIL (its HELLO, its chunks) arrive after the
        close, and a reset loses the FAIL in flight, so the peer saw "closed the stream" instead of the
        reason (a refused stranger in tests/net/test_trust.py, 3 runs in 15)."""
        await self.fail(reason)
        try:
            async with asyncio.timeout(min(self.stall, 5.0)):
                while await self.reader.read(PIECE):
                    pass
        except (TimeoutError, ConnectionError):
            pass

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    async def _read(self, n: int) -> bytearray:
        buffer, got = bytearray(n), 0
        view = memoryview(buffer)
        try:
            async with asyncio.timeout(self.stall) as watchdog:
                while got < n:
                    piece = await self.reader.read(min(n - got, 4 * PIECE))
                    if not piece:
                        raise Closed(f"{self.peer} closed the stream")
                    view[got:got + len(piece)] = piece
                    got += len(piece)
                    watchdog.reschedule(asyncio.get_running_loop().time() + self.stall)
        except TimeoutError:
            raise Stalled(f"{self.peer} sent no byte for {self.stall:g} s (swarm.stall_timeout)") from None
        except ConnectionError as e:
            raise Closed(f"stream from {self.peer} broke: {e}") from None
        self.traffic.received += n
        return buffer


Handler = Callable[[Channel], Awaitable[None]]


async def serve(p2p: P2P, name: str, stall: float, handler: Handler) -> None:
    """Register `handler(channel)` for incoming streams named `name`; the channel is closed after it returns."""

    async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer, info.peer_id, stall)
        try:
            await handler(channel)
        except WireError as e:  # the peer left, stalled or misbehaved: its stream ends here, nothing else does
            logger.info(f"stream {name} from {info.peer_id}: {e}")
        except asyncio.CancelledError:  # this peer is shutting down; the stream ends with it
            pass
        finally:
            channel.close()

    await p2p.add_binary_stream_handler(name, on_stream)
