"""The data plane (swarm/net/dataplane.py): the all-reduce's bytes on direct, sealed TCP connections, the fallback
to libp2p for an owner that cannot be dialed, and what a stranger on its port can and cannot do."""

import asyncio
import logging
import os
import socket

import pytest
import torch
from conftest import all_reduces, three_dhts

from swarm.net.allreduce.groupstate import Contribution
from swarm.net.allreduce.layout import WireLayout
from swarm.net.codec import get_codec
from swarm.net.dataplane import KEY, TICKET, DataPlane, SealedChannel, Tampered, dial, hosts_of, parse_offer
from swarm.net.identity import owner_key
from swarm.net.wire import Kind, ProtocolError, Stalled

PEER = "QmStrangerStrangerStrangerStrangerStrangerStr"  # what a channel names in its errors


@pytest.fixture
def dhts():
    with three_dhts() as started:
        yield started


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens there once this returns


def average(dhts, planes, n=200_000, chunk_elements=16_384):
    """One all-reduce of three random vectors among `dhts`, each with its `DataPlane` (or None); the results."""
    vectors = [torch.randn(n) for _ in dhts]

    async def main():
        async with all_reduces(dhts, planes=planes) as (p2ps, services):
            members = [p2p.peer_id for p2p in p2ps]
            keys = [owner_key(dht.identity.owner) for dht in dhts]
            layout = WireLayout([torch.Size([n])], get_codec("none"), len(members), chunk_elements)

            async def one(service, vector):
                out = [torch.full((n,), float("nan"))]
                read = lambda i, a, b: vector[a:b].clone()  # noqa: E731
                await service.run(b"g", members, layout, Contribution(read, 1.0, out), [1.0] * len(members), keys)
                return out[0]
            results = await asyncio.gather(*[one(s, v) for s, v in zip(services, vectors)])
            for service in services:
                await service.drain()
            return results
    return asyncio.run(main()), torch.stack(vectors).mean(0)


@pytest.mark.timeout(60)
def test_the_bytes_go_over_the_data_plane_and_the_result_is_the_same(dhts):
    planes = [DataPlane(["127.0.0.1"], 0, 10.0) for _ in dhts]
    results, expected = average(dhts, planes)
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.allclose(results[0], expected, atol=1e-6)
    assert [p.accepted for p in planes] == [2, 2, 2]  # every member dialed every other owner


@pytest.mark.timeout(60)
def test_an_owner_that_cannot_be_dialed_gets_its_part_over_libp2p(dhts, caplog):
    planes = [DataPlane(["127.0.0.1"], 0, 10.0) for _ in dhts]
    unreachable = planes[0].start

    async def advertise_a_closed_port(hosts):  # a firewall in front of member 0's data port
        await unreachable(hosts)
        planes[0].endpoints = [("127.0.0.1", closed_port())]
    planes[0].start = advertise_a_closed_port
    with caplog.at_level(logging.INFO, logger="swarm.net.dataplane"):
        results, expected = average(dhts, planes)
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.allclose(results[0], expected, atol=1e-6)
    assert planes[0].accepted == 0 and planes[1].accepted == planes[2].accepted == 2
    assert sum("cannot reach" in r.getMessage() and "data plane" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.timeout(60)
def test_peers_without_a_data_plane_average_with_those_that_have_one(dhts):
    planes = [DataPlane(["127.0.0.1"], 0, 10.0), None, DataPlane(None, 0, 10.0)]  # a server, none, dial only
    results, expected = average(dhts, planes)
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.allclose(results[0], expected, atol=1e-6)
    assert planes[0].accepted == 1  # member 2 dialed it; member 1 never asks


# ---- strangers on the port ---------------------------------------------------------------------------------

async def started_plane(stall=2.0) -> DataPlane:
    plane = DataPlane(["127.0.0.1"], 0, stall)
    await plane.start(["127.0.0.1"])
    return plane


async def closed_by(plane: DataPlane, payload: bytes, within: float) -> bool:
    """Whether the plane closes a connection that sends `payload`, within `within` s."""
    reader, writer = await asyncio.open_connection(*plane.endpoints[0])
    writer.write(payload)
    try:
        async with asyncio.timeout(within):
            return await reader.read() == b""
    finally:
        writer.close()


@pytest.mark.timeout(30)
def test_a_connection_without_a_ticket_we_gave_is_closed():
    async def main():
        plane = await started_plane()
        offer, ticket = plane.offer(PEER)
        endpoints, real, key = parse_offer(offer)
        assert await dial(endpoints, os.urandom(TICKET), key, PEER, 2.0) is None  # a made-up ticket
        assert await dial(endpoints, real, os.urandom(KEY), PEER, 2.0) is None  # our ticket, not its key
        assert not ticket.taken.done()  # neither spent it: the member it was given to still can

        async def confirm():  # what the owner's all-reduce does with the connection it took
            await (await ticket.taken).send(Kind.HELLO)
        confirming = asyncio.ensure_future(confirm())
        channel = await dial(endpoints, real, key, PEER, 2.0)
        await confirming
        assert channel is not None and plane.accepted == 1
        assert await dial(endpoints, real, key, PEER, 2.0) is None  # replayed: spent
        channel.close()
        ticket.taken.result().close()
        await plane.stop()
    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_silent_or_trickling_connection_is_dropped_within_the_stall():
    async def main():
        plane = await started_plane(stall=0.5)
        offer, _ = plane.offer(PEER)
        assert await closed_by(plane, b"", within=3.0)  # says nothing
        assert await closed_by(plane, offer["ticket"], within=3.0)  # a ticket, then no frame
        assert plane.accepted == 0
        await plane.stop()
    asyncio.run(main())


@pytest.mark.timeout(30)
def test_an_expired_ticket_is_refused():
    async def main():
        plane = await started_plane(stall=0.3)
        offer, ticket = plane.offer(PEER)
        await asyncio.sleep(0.5)
        assert ticket.taken.cancelled()
        assert await dial(*parse_offer(offer), PEER, 2.0) is None
        await plane.stop()
    asyncio.run(main())


def sealed_pair(stall=2.0):
    """Two ends of one sealed connection over a socket pair, sharing a key: (dialer, owner)."""
    key = os.urandom(KEY)

    async def make():
        a, b = socket.socketpair()
        ra, wa = await asyncio.open_connection(sock=a)
        rb, wb = await asyncio.open_connection(sock=b)
        return SealedChannel(ra, wa, PEER, stall, key, dialer=True), SealedChannel(rb, wb, PEER, stall, key, dialer=False)
    return make()


@pytest.mark.timeout(30)
def test_sealed_frames_round_trip_and_refuse_what_is_too_large_before_reading_it():
    async def main():
        member, owner = await sealed_pair()
        await member.send(Kind.CHUNK, b"x" * 1000)
        await owner.send(Kind.RESULT, b"y" * 10)
        assert await owner.recv_kind(Kind.CHUNK, 1000) == b"x" * 1000
        assert await member.recv_kind(Kind.RESULT, 10) == b"y" * 10
        await member.send(Kind.CHUNK, b"z" * 1001)
        with pytest.raises(ProtocolError, match="announced 1017 bytes where at most 1000 fit"):
            await owner.recv_kind(Kind.CHUNK, 1000)
        member.close(), owner.close()
    asyncio.run(main())


async def relayed(stall=0.5):
    """A sealed connection whose bytes pass through our hands: (dialer, owner, raw reader of what the dialer
    sends, raw writer of what the owner receives)."""
    key = os.urandom(KEY)
    a, a_raw = socket.socketpair()
    b_raw, b = socket.socketpair()
    ra, wa = await asyncio.open_connection(sock=a)
    rb, wb = await asyncio.open_connection(sock=b)
    sent, keep_a = await asyncio.open_connection(sock=a_raw)
    keep_b, deliver = await asyncio.open_connection(sock=b_raw)
    KEPT.extend([keep_a, keep_b])  # an unreferenced StreamWriter closes its socket
    member = SealedChannel(ra, wa, PEER, stall, key, dialer=True)
    return member, SealedChannel(rb, wb, PEER, stall, key, dialer=False), sent, deliver


KEPT: list = []


@pytest.mark.timeout(30)
def test_an_altered_replayed_or_stalled_frame_is_not_taken():
    async def main():
        member, owner, sent, deliver = await relayed()
        await member.send(Kind.CHUNK, b"payload")
        frame = await sent.readexactly(5 + 7 + 16)
        deliver.write(frame[:6] + bytes([frame[6] ^ 1]) + frame[7:])  # one bit flipped on the way
        with pytest.raises(Tampered):
            await owner.recv(100)

        member, owner, sent, deliver = await relayed()
        await member.send(Kind.CHUNK, b"payload")
        frame = await sent.readexactly(5 + 7 + 16)
        deliver.write(frame + frame)  # the same frame twice
        assert await owner.recv_kind(Kind.CHUNK, 100) == b"payload"
        with pytest.raises(Tampered):
            await owner.recv(100)
        with pytest.raises(Stalled):
            await member.recv(100)  # the owner says nothing
    asyncio.run(main())


def test_where_a_peer_listens_and_what_an_offer_may_say():
    assert hosts_of(["/ip4/127.0.0.1/tcp/1", "/ip4/10.0.0.2/tcp/1/p2p/QmX", "/ip6/::1/tcp/2", "/dns/x/tcp/3",
                     "/ip4/10.0.0.2/tcp/4"]) == ["10.0.0.2", "127.0.0.1", "::1"]  # loopback last
    assert parse_offer({}) is None and parse_offer({"endpoints": []}) is None  # no data plane there
    good = {"endpoints": [["10.0.0.2", 4000]], "ticket": b"t" * TICKET, "key": b"k" * KEY}
    assert parse_offer(good) == ([("10.0.0.2", 4000)], b"t" * TICKET, b"k" * KEY)
    for bad in ({"ticket": b"short"}, {"key": "text"}, {"endpoints": [["h", 0]]}, {"endpoints": [["h"]]},
                {"endpoints": "10.0.0.2:4000"}, {"endpoints": [[4000, "h"]]}):
        with pytest.raises(ValueError):
            parse_offer({**good, **bad})

