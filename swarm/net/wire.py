"""Frames over raw libp2p streams: bounded memory whatever the peer sends, and waits that end.

hivemind's protobuf streams read a whole message of whatever length the peer announces before anyone can
check it. Here every stream is a `Channel` of frames `[kind: u8][length: u32 LE][payload]`, and the reader
names the largest payload it accepts before a byte of it is read: a peer that announces more is refused
(`ProtocolError`), never buffered. Payloads are read straight into one buffer of the announced size.

The buffer a payload is read into grows with the bytes that arrived, never to the announced length first:
a peer that announces the most a frame may hold and then sends a byte at a time (a trickle) costs what
it sent, not what it announced.

Time-outs follow progress, not the whole operation:
- `stall`: a read or write that moves no byte for this long raises `Stalled`. Raise
  `swarm.stall_timeout` if you see "stalled" on a link that is slow but alive; lower it if a dead peer
  holds an outer step up for too long.
- The floor on bandwidth (`swarm.min_bandwidth`) is enforced by the caller around a whole transfer
  (`budget.transfer_deadline`), since only it knows how many bytes the transfer has to move.
- An incoming stream's first frame (its HELLO, a few hundred bytes sent in one write) must be whole within
  `FIRST_FRAME_STALLS` x stall of the stream's start: a peer that keeps a stream alive with a byte per
  stall never gets past it (`Trickled`, an offense: no honest peer sends a HELLO a byte at a time).

Every incoming stream passes `serve`'s gates before a byte of it is read: the stream caps of its peer
(`limits.Streams`: per peer and in total, over all of the peer's handlers) and its `Access` (allowlist, bans).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Awaitable, Callable

from hivemind.p2p import P2P, PeerID
from hivemind.utils.serializer import MSGPackSerializer

from swarm.errors import SwarmError
from swarm.net.access import Access
from swarm.net.limits import streams_of
from swarm.net.tasks import keep

logger = logging.getLogger(__name__)

HEADER = struct.Struct("<BI")
FIRST_FRAME_STALLS = 2  # an incoming stream's first frame must be whole within this many stall periods
PIECE = 2**16  # writes are drained, and reads taken, at most this many bytes at a time
CONTROL_BYTES = 2**22  # the largest control payload (hello, request, manifest) anyone accepts
FAIL_REASON = 400  # bytes of a FAIL's reason; with a culprit's peer id it fits the 512 bytes a DONE slot takes


class Kind(IntEnum):
    HELLO = 1  # msgpack dict: who we are, which group or state we want
    CHUNK = 2  # encoded chunk of a contribution
    RESULT = 3  # encoded chunk of a part's average
    DONE = 4  # the sender holds the whole average: it will ask for nothing more
    FAIL = 5  # utf-8 reason: the sender gives up on this stream
    MANIFEST = 6  # msgpack dict describing the state that follows
    DATA = 7  # bytes of a state tensor
    DIGEST = 8  # msgpack dict: an owner's signed digest of the result it sent (allreduce/agree.py)


class WireError(SwarmError):
    """A stream ended, stalled or carried something it should not."""


class Stalled(WireError):
    pass


class Closed(WireError):
    pass


class ProtocolError(WireError):
    """The peer sent something no honest peer sends (too large, wrong kind, malformed)."""


class PeerFailed(WireError):
    """The peer sent a FAIL frame with its reason; `culprit`: the peer it holds responsible, if it named one
    (its word only: see allreduce/groupstate.py, `Blame`)."""

    def __init__(self, reason: str, culprit: PeerID | None = None):
        super().__init__(reason)
        self.culprit = culprit


def fail_payload(reason: str, culprit: PeerID | None = None) -> bytes:
    """A FAIL frame's payload: the utf-8 reason (at most FAIL_REASON bytes), then NUL and the culprit's base58
    peer id if it names one."""
    return reason.encode()[:FAIL_REASON] + (b"\0" + culprit.to_base58().encode() if culprit is not None else b"")


def parse_fail(peer: PeerID, payload: bytes | bytearray) -> PeerFailed:
    reason, _, named = bytes(payload).partition(b"\0")
    try:
        culprit = PeerID.from_base58(named.decode("ascii")) if 0 < len(named) <= 64 else None
    except ValueError:
        culprit = None  # an unreadable name names nobody
    return PeerFailed(f"{peer}: {reason[:FAIL_REASON].decode(errors='replace')}", culprit)


class Trickled(ProtocolError):
    """The peer kept its first frame coming a few bytes at a time, past the first-frame deadline."""


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
        self.deadline: float | None = None  # loop time by which the next frame must be whole (`serve`: the first)
        self._partial = 0  # bytes of the frame being read so far
        self._mid_frame = False  # a send broke off (the stream failed) between the pieces of its frame
        self._reading = asyncio.Lock()  # asyncio allows one reader per stream: frames and `drain` take turns
        self._writing = asyncio.Lock()  # and frames go out one at a time
        self.peer_failed = False  # the peer sent FAIL: it closes once we do, so draining it waits for nothing
        self.on_first_frame: Callable[[], None] | None = None  # called once the frame under `deadline` is whole
        self._closing: asyncio.Future | None = None  # `close`'s wait for the stream's end

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
        """The next frame; refuses (ProtocolError) a payload announced larger than `max_bytes`, and (Trickled) a
        frame not whole by `deadline`, if one is set (it applies to this frame only)."""
        if self.deadline is None:
            return await self._recv(max_bytes)
        deadline, self.deadline = self.deadline, None
        try:
            async with asyncio.timeout_at(deadline):
                frame = await self._recv(max_bytes)
        except TimeoutError:
            raise Trickled(f"{self.peer} sent {self._partial} bytes of its first frame, a few at a time, and not "
                           f"all of it within {FIRST_FRAME_STALLS} x {self.stall:g} s (a trickle)") from None
        if self.on_first_frame is not None:
            self.on_first_frame()
        return frame

    async def _recv(self, max_bytes: int) -> tuple[Kind, bytearray]:
        async with self._reading:  # a whole frame: `drain` (bounded) waits for its end
            self._partial = 0
            header = bytes(await self._read(HEADER.size))
            kind, length = HEADER.unpack(header)
            if kind not in Kind._value2member_map_:
                raise ProtocolError(f"{self.peer} sent a frame of unknown kind {kind}")
            if length > self._room(max_bytes):
                raise ProtocolError(f"{self.peer} announced {length} bytes where at most {max_bytes} fit")
            payload = self._open(header, length, await self._read(length))
        if kind == Kind.FAIL:
            self.peer_failed = True
            raise parse_fail(self.peer, payload)
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
        """One frame. Frames go one at a time: a send waits for the frame in flight (say, a cancelled push
        finishing its frame, `_finish_frame`), so that a FAIL is read as a FAIL."""
        async with self._writing:
            if self._mid_frame:
                raise Closed(f"stream to {self.peer} broke off in the middle of a frame")
            header, view = self._frame(kind, memoryview(payload).cast("B"))
            try:
                async with asyncio.timeout(self.stall) as watchdog:
                    self.writer.write(header)
                    for offset in range(0, max(len(view), 1), PIECE):
                        self.writer.write(view[offset:offset + PIECE])
                        self._mid_frame = offset + PIECE < len(view)
                        try:
                            await self.writer.drain()
                        except asyncio.CancelledError:
                            self._finish_frame(view[offset + PIECE:])
                            raise
                        watchdog.reschedule(asyncio.get_running_loop().time() + self.stall)
            except TimeoutError:
                raise Stalled(f"{self.peer} took no byte for {self.stall:g} s (swarm.stall_timeout)") from None
            except (ConnectionError, RuntimeError) as e:  # RuntimeError: "unable to perform operation on closed"
                raise Closed(f"stream to {self.peer} closed: {e}") from None
        self.traffic.sent += len(header) + len(view)

    def _finish_frame(self, rest: memoryview) -> None:
        """A send cancelled between the pieces of its frame: the rest goes into the stream's buffer (no wait), so
        that the stream stays at a frame boundary and our FAIL can follow. Closing instead would tell the peer only
        that we closed, and it would blame us for a failure we know the culprit of."""
        if self._mid_frame and not self.writer.is_closing():
            self.writer.write(rest)
            self._mid_frame = False

    # How a frame travels: as is here; sealed on the data plane (dataplane.SealedChannel).
    def _frame(self, kind: Kind, view: memoryview) -> tuple[bytes, memoryview]:
        """The header and the bytes that follow it on the wire, for a payload `view`."""
        return HEADER.pack(kind, len(view)), view

    def _room(self, max_bytes: int) -> int:
        """The most bytes a frame may announce for a payload of at most `max_bytes`."""
        return max_bytes

    def _open(self, header: bytes, length: int, payload: bytearray) -> bytearray:
        """The payload of a frame read whole (`header`, then `length` bytes)."""
        return payload

    async def send_control(self, kind: Kind, value: dict[str, Any]) -> None:
        await self.send(kind, MSGPackSerializer.dumps(value))

    async def fail(self, reason: str, culprit: PeerID | None = None) -> None:
        """Tell the peer why we give up (and whom we hold responsible), if it still listens; never raises. A
        stream a send broke off mid-frame is closed instead: a FAIL would read as the frame's payload."""
        try:
            await asyncio.wait_for(self.send(Kind.FAIL, fail_payload(reason, culprit)), min(self.stall, 5.0))
        except (WireError, TimeoutError):
            if self._mid_frame:
                self.close()

    async def refuse(self, reason: str, culprit: PeerID | None = None) -> None:
        """`fail`, then wait (at most min(stall, 5) s) for the peer to close, discarding what it still sends.
        For a handler that turns a stream away, with no other task reading it: closing at once resets the
        stream when bytes the peer wrote before reading our FAIL (its HELLO, its chunks) arrive after the
        close, and a reset loses the FAIL in flight: the peer would see "closed the stream" instead of the
        reason."""
        await self.fail(reason, culprit)
        with contextlib.suppress(OSError, RuntimeError):
            if self.writer.can_write_eof():
                self.writer.write_eof()  # the peer's own drain ends here, not after min(stall, 5) s
        await self.drain()

    async def drain(self) -> None:
        """Discard what the peer still sends until it closes, at most min(stall, 5) s (see `refuse`); nothing if
        it sent FAIL (it waits for our close)."""
        if self.peer_failed:
            return
        try:
            async with asyncio.timeout(min(self.stall, 5.0)):
                async with self._reading:  # after a frame another task is reading (a failed group's exchange)
                    while await self.reader.read(PIECE):
                        pass
        except (TimeoutError, ConnectionError):
            pass

    def close(self) -> None:
        """Close the stream: what we wrote still goes out, for at most `stall` s; then the stream is cut."""
        if self._closing is None:
            self.writer.close()
            self._closing = keep(asyncio.ensure_future(closed(self.writer, self.stall)), _CLOSING)

    async def _read(self, n: int) -> bytearray:
        """`n` bytes, in a buffer that grows as they arrive (never allocated at `n` before they do)."""
        buffer = bytearray()
        try:
            async with asyncio.timeout(self.stall) as watchdog:
                while len(buffer) < n:
                    piece = await self.reader.read(min(n - len(buffer), 4 * PIECE))
                    if not piece:
                        raise Closed(f"{self.peer} closed the stream")
                    buffer += piece
                    self._partial += len(piece)
                    watchdog.reschedule(asyncio.get_running_loop().time() + self.stall)
        except TimeoutError:
            raise Stalled(f"{self.peer} sent no byte for {self.stall:g} s (swarm.stall_timeout)") from None
        except ConnectionError as e:
            raise Closed(f"stream from {self.peer} broke: {e}") from None
        self.traffic.received += n
        return buffer


_CLOSING: set[asyncio.Future] = set()  # streams closing, until they have (asyncio holds tasks weakly)


async def closed(writer: asyncio.StreamWriter, stall: float) -> None:
    """Wait for a stream we closed to end, at most `stall` s (then cut it: the peer reads nothing more), and take
    the error a broken stream ended with, which its readers and writers have seen as their own (tasks.py says
    why it must be taken). The wait is shielded: cancelling it would cancel the stream's own close future, which
    others may be waiting on too."""
    writer.close()
    ending = asyncio.shield(writer.wait_closed())
    try:
        if not (await asyncio.wait({ending}, timeout=stall))[0]:
            writer.transport.abort()
        await ending
    except OSError as e:  # ConnectionResetError, BrokenPipeError
        logger.debug(f"a stream ended with {e!r}")


Handler = Callable[[Channel], Awaitable[None]]


async def serve(p2p: P2P, name: str, stall: float, handler: Handler, access: Access | None = None) -> None:
    """Register `handler(channel)` for incoming streams named `name`; the channel is closed after it returns.
    Before a byte is read: a stream over its peer's caps (`limits.streams_of(p2p)`, shared by every handler
    on `p2p`; a stream still waiting for its first frame may give way to it) or from a peer `access` refuses
    gets FAIL and is closed; its first frame must then be whole within FIRST_FRAME_STALLS x `stall` (a
    trickler is charged an offense)."""
    streams = streams_of(p2p)

    async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer, info.peer_id, stall)

        def evict() -> None:  # a newer stream took this one's place before its first frame came (limits.Streams)
            if access is not None:
                access.note("streams", info.peer_id, f"{info.peer_id}: a stream of {name} that sent no first frame "
                                                      f"gave way to a newer one")
            channel.close()
        ticket = streams.take(info.peer_id, evict)
        if isinstance(ticket, str):
            if access is not None:
                access.note("streams", info.peer_id, ticket)
            await channel.fail(ticket)
            return channel.close()
        channel.on_first_frame = lambda: streams.arrived(ticket)
        try:
            if access is not None and not access.admits(info.peer_id):
                # FAIL, then read until the peer closes: no EOF of ours (`refuse`), on which the daemon closes the
                # stream whole, so that a HELLO it sends after our FAIL left fails ("Connection lost") before it
                # reads why (tests/net/test_trust.py, once in a loaded run; every run with the HELLO 0.5 s late)
                await channel.fail(access.refusal(info.peer_id))
                return await channel.drain()
            channel.deadline = asyncio.get_running_loop().time() + FIRST_FRAME_STALLS * stall
            await handler(channel)
        except Trickled as e:
            if access is not None:
                access.offense(info.peer_id, str(e))
            logger.info(f"stream {name} from {info.peer_id}: {e}")
        except WireError as e:  # the peer left, stalled or misbehaved: its stream ends here, nothing else does
            logger.info(f"stream {name} from {info.peer_id}: {e}")
        except asyncio.CancelledError:  # this peer is shutting down; the stream ends with it
            pass
        finally:
            streams.release(ticket)
            channel.close()

    await p2p.add_binary_stream_handler(name, on_stream)
