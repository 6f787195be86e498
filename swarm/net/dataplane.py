"""The data plane: an all-reduce's bulk bytes on a direct TCP connection between two groupmates, sealed with
AES-GCM, wherever the member can dial the owner; libp2p keeps discovery, matchmaking and control, and carries
the bytes itself where no direct connection can be made.

Why: a libp2p stream passes through two p2pd daemons (a unix socket into ours, the libp2p connection, a unix
socket out of theirs), and on the 2-core dev box the daemons took a third of an all-reduce's CPU
(bench/results/README.md, §12).

How a member's stream to an owner moves to TCP (allreduce.py, `_exchange` and `_serve_contributions`):
1. The member's HELLO on the libp2p stream asks for it (`direct: true`).
2. The owner, having checked the member (access, group, weight), answers on that stream with an offer: its
   endpoints (host, port), a fresh 32-byte key and a 16-byte ticket. libp2p streams are authenticated by peer
   id and encrypted, so only that member learns them; the owner runs no data plane: no endpoints.
3. The member dials an endpoint (at most DIAL_TIMEOUT s each), sends the ticket and one sealed, empty HELLO.
   The owner takes the connection only if the ticket is one it issued and still waits for, and the HELLO opens
   under that ticket's key; the ticket is then spent (a replay finds it gone). The owner confirms with a sealed
   HELLO, and the exchange runs on the connection from then on.
4. A member that cannot dial, or gets no confirmation, says so on the libp2p stream (HELLO `direct: false`) and
   the exchange runs there, as before; it then skips the data plane to that owner for UNDIALABLE_FOR s.

Sealed frames (`SealedChannel`): `wire.py`'s header [kind][length] in clear, authenticated as AES-GCM's
associated data, then the encrypted payload and its 16-byte tag. Nonces count frames per direction, so a frame
dropped, replayed or reordered fails to open: `Tampered`, and the connection is cut (a fault of the link, not
provably of the peer: no offense). AES-GCM runs at ~10 GB/s on one core of the dev box (AES-NI).

Bounded: a connection must show its ticket and first frame within `stall` s, at most MAX_UNAUTHENTICATED at once;
a ticket expires after `stall` s; the first frame is at most empty (nothing is allocated on an unauthenticated
word). An owner may name any endpoint, so a member dials at most MAX_ENDPOINTS of them and sends a stranger
there only random bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.p2p import PeerID

from swarm.net.tasks import cancel_all
from swarm.net.wire import HEADER, Channel, Kind, ProtocolError, Stalled, Traffic, WireError, closed

logger = logging.getLogger(__name__)

KEY, TICKET, TAG = 32, 16, 16  # bytes
DIAL_TIMEOUT = 3.0  # seconds to connect to one endpoint before trying the next (or falling back to libp2p)
UNDIALABLE_FOR = 600.0  # seconds a member goes straight to libp2p with an owner it could not dial
MAX_ENDPOINTS = 4  # of an offer, tried in order
MAX_UNAUTHENTICATED = 64  # connections that have not shown a valid ticket and first frame yet


class Tampered(WireError):
    """A sealed frame did not open under its connection's key: altered, replayed or reordered on the way."""


class SealedChannel(Channel):
    """A `Channel` on a direct TCP connection whose frames are sealed with AES-GCM (module docstring)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: PeerID, stall: float,
                 key: bytes, dialer: bool, traffic: Optional[Traffic] = None):
        super().__init__(reader, writer, peer, stall, traffic)
        self._aead = AESGCM(key)
        self._out_prefix, self._in_prefix = (b"\x00", b"\x01") if dialer else (b"\x01", b"\x00")
        self._sent = self._opened = 0  # frames sealed and opened: the nonces

    def _frame(self, kind: Kind, view: memoryview) -> tuple[bytes, memoryview]:
        header = HEADER.pack(kind, len(view) + TAG)
        nonce = self._out_prefix + self._sent.to_bytes(11, "big")
        self._sent += 1
        return header, memoryview(self._aead.encrypt(nonce, view, header))

    def _room(self, max_bytes: int) -> int:
        return max_bytes + TAG

    def _open(self, header: bytes, length: int, payload: bytearray) -> bytearray:
        if length < TAG:
            raise Tampered(f"a sealed frame from {self.peer} is shorter than its tag")
        plain = bytearray(length - TAG)
        nonce = self._in_prefix + self._opened.to_bytes(11, "big")
        try:
            self._aead.decrypt_into(nonce, payload, header, plain)
        except InvalidTag:
            raise Tampered(f"a sealed frame from {self.peer} did not open: the connection was tampered with "
                           f"(or is not the one its ticket was given for)") from None
        self._opened += 1
        return plain


@dataclass
class _Ticket:
    peer: PeerID
    key: bytes
    taken: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def hosts_of(maddrs: Sequence[object]) -> list[str]:
    """The IP hosts of multiaddrs (`/ip4/H/tcp/P...`, `/ip6/H/...`), in order, without repeats; loopback last."""
    hosts: list[str] = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and parts[2] not in hosts:
            hosts.append(parts[2])
    return sorted(hosts, key=lambda h: ipaddress.ip_address(h).is_loopback)


class DataPlane:
    """One peer's end of the data plane: a TCP server that takes the connections its tickets were given for."""

    def __init__(self, bind_hosts: Optional[Sequence[str]], port: int, stall: float):
        """`bind_hosts`: where to listen (the hosts of `swarm.host_maddrs`), None: dial only (a client, which
        nobody dials); `port`: `swarm.data_port`, 0: any free port."""
        self.serves = bind_hosts is not None
        self.bind_hosts, self.port, self.stall = list(bind_hosts or ()) or ["0.0.0.0"], port, stall
        self.endpoints: list[tuple[str, int]] = []  # what offers name: (host others reach us at, port)
        self.accepted = 0  # connections taken, for tests and logs
        self._server: Optional[asyncio.Server] = None
        self._tickets: dict[bytes, _Ticket] = {}
        self._unauthenticated = 0

    async def start(self, advertised_hosts: Sequence[str]) -> None:
        """Listen; `advertised_hosts`: the hosts others dial us at (our visible libp2p addresses)."""
        if not self.serves:
            return
        self._server = await asyncio.start_server(self._accept, self.bind_hosts, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.endpoints = [(host, port) for host in advertised_hosts][:MAX_ENDPOINTS]
        logger.info(f"data plane listening on {', '.join(f'{h}:{port}' for h in self.bind_hosts)}")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def offer(self, peer: PeerID) -> tuple[dict[str, Any], _Ticket]:
        """What to tell `peer` on its libp2p stream, and the ticket whose `taken` gives its connection."""
        ticket, entry = os.urandom(TICKET), _Ticket(peer, os.urandom(KEY))
        self._tickets[ticket] = entry
        asyncio.get_running_loop().call_later(self.stall, self.withdraw, ticket)
        return {"endpoints": [list(e) for e in self.endpoints], "ticket": ticket, "key": entry.key}, entry

    def withdraw(self, ticket: bytes) -> None:
        """The ticket is spent, given up or expired: no connection can use it any more."""
        entry = self._tickets.pop(ticket, None)
        if entry is not None and not entry.taken.done():
            entry.taken.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._unauthenticated >= MAX_UNAUTHENTICATED:
            return await closed(writer, self.stall)
        self._unauthenticated += 1
        channel = entry = None
        try:
            async with asyncio.timeout(self.stall):
                ticket = await reader.readexactly(TICKET)
                entry = self._tickets.get(ticket)
                if entry is not None:
                    channel = SealedChannel(reader, writer, entry.peer, self.stall, entry.key, dialer=False)
                    await channel.recv_kind(Kind.HELLO, 0)
        except (TimeoutError, asyncio.IncompleteReadError, WireError, OSError) as e:
            logger.debug(f"data plane: a connection without a valid ticket and first frame: {e!r}")
            channel = None
        finally:
            self._unauthenticated -= 1
        if channel is None or self._tickets.get(ticket) is not entry or entry.taken.done():
            return await closed(writer, self.stall)
        del self._tickets[ticket]
        _nodelay(writer)
        self.accepted += 1
        entry.taken.set_result(channel)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def parse_offer(offer: dict[str, Any]) -> Optional[tuple[list[tuple[str, int]], bytes, bytes]]:
    """(endpoints, ticket, key) of an owner's offer; None if it offers no data plane; ValueError if malformed."""
    endpoints = offer.get("endpoints")
    if not endpoints:
        return None
    ticket, key = offer.get("ticket"), offer.get("key")
    if not (isinstance(endpoints, list) and isinstance(ticket, bytes) and len(ticket) == TICKET
            and isinstance(key, bytes) and len(key) == KEY):
        raise ValueError("a malformed data-plane offer")
    out = []
    for e in endpoints[:MAX_ENDPOINTS]:
        if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int)
                and 0 < e[1] < 65536):
            raise ValueError(f"a malformed data-plane endpoint {e!r}")
        out.append((e[0], e[1]))
    return out, ticket, key


async def dial(endpoints: Sequence[tuple[str, int]], ticket: bytes, key: bytes, peer: PeerID, stall: float,
               traffic: Optional[Traffic] = None) -> Optional[SealedChannel]:
    """A sealed connection to `peer` at one of `endpoints` that confirmed our ticket; None if none did."""
    for host, port in endpoints:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), min(DIAL_TIMEOUT, stall))
        except (OSError, TimeoutError) as e:
            logger.debug(f"data plane: cannot dial {peer} at {host}:{port}: {e!r}")
            continue
        _nodelay(writer)
        channel = SealedChannel(reader, writer, peer, stall, key, dialer=True, traffic=traffic)
        try:
            writer.write(ticket)
            await channel.send(Kind.HELLO)
            await channel.recv_kind(Kind.HELLO, 0)  # the owner took it
            return channel
        except WireError as e:
            logger.debug(f"data plane: {peer} at {host}:{port} did not take our ticket: {e}")
            with contextlib.suppress(OSError, RuntimeError):
                channel.close()
    return None


async def switch(channel: Channel, stall: float, traffic: Traffic, undialable: dict[PeerID, float]) -> Channel:
    """The member's side, its HELLO having asked for the data plane: the owner's sealed connection if it offers one
    we can dial, else `channel`; an owner we cannot dial is told so and goes into `undialable` (until when)."""
    peer = channel.peer
    try:
        offer = parse_offer(await channel.recv_control())
    except ValueError as e:
        raise ProtocolError(f"{peer}: {e}") from None
    if offer is None:  # it runs no data plane
        return channel
    direct = await dial(*offer, peer, stall, traffic)
    if direct is None:
        logger.info(f"all-reduce: cannot reach {peer} on its data plane; its part goes over libp2p, and so will "
                    f"the next {UNDIALABLE_FOR:.0f} s of parts (open swarm.data_port to it?)")
        undialable[peer] = asyncio.get_running_loop().time() + UNDIALABLE_FOR
        await channel.send_control(Kind.HELLO, {"direct": False})
        return channel
    channel.close()  # the owner switched too: it confirmed on the connection
    return direct


async def answer(plane: Optional[DataPlane], channel: Channel, stall: float) -> Channel:
    """The owner's side, a member having asked for the data plane: offer it, and return the channel the exchange
    runs on, the member's connection or (it could not dial, or we serve none) `channel`."""
    if plane is None or not plane.serves:
        await channel.send_control(Kind.HELLO, {})
        return channel
    offer, ticket = plane.offer(channel.peer)
    await channel.send_control(Kind.HELLO, offer)
    declined, done = asyncio.ensure_future(channel.recv_control()), set()
    try:
        done, _ = await asyncio.wait({ticket.taken, declined}, timeout=stall, return_when=asyncio.FIRST_COMPLETED)
    finally:
        plane.withdraw(offer["ticket"])
        if declined not in done:
            cancel_all([declined])
    if declined in done:  # the member's own word: it stays on this stream
        if ticket.taken.done() and not ticket.taken.cancelled():
            ticket.taken.result().close()
        if declined.result().get("direct") is not False:
            raise ProtocolError(f"{channel.peer} sent a second HELLO that is not a data-plane refusal")
        return channel
    if not done:
        raise Stalled(f"{channel.peer} neither dialed our data plane nor declined it within {stall:g} s")
    direct = ticket.taken.result()
    await direct.send(Kind.HELLO)  # we switched: the member may leave the stream
    return direct
