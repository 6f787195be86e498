"""Bounded resources: access checks before a byte is read, stream caps, buffers that grow with what arrived, the
first-frame deadline against a trickle, the open-file limit, waits that end, and bounds on records. All in this process: streams
are socket pairs between stand-ins for P2P (loopback_p2p.py), the DHT a stand-in that never answers."""

import asyncio
import concurrent.futures
import resource
import threading
import time
import tracemalloc

import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration
from loopback_p2p import LoopbackNet

from swarm.config import SwarmConfig
from swarm.errors import SwarmError
from swarm.net import dht as dht_module
from swarm.net import limits, policy, schema, statesync
from swarm.net.access import Access
from swarm.net.hostile import TRICKLE_STREAMS, Attacker, Hooks, Reach
from swarm.net.identity import load_identity
from swarm.net.records import Records
from swarm.net.wire import HEADER, Channel, Closed, Kind, PeerFailed, serve
from swarm.state.statehash import state_sha256, tensors_digest
from swarm.train.averaging import Intake, Snapshot

STALL = 0.3


def test_stream_caps_count_per_peer_and_in_total():
    streams = limits.Streams(total=3, per_peer=2)
    a1, a2 = streams.take("a"), streams.take("a")
    for ticket in (a1, a2):
        streams.arrived(ticket)
    assert "the most one peer may (2)" in streams.take("a")
    b = streams.take("b")
    streams.arrived(b)
    assert "the most it takes (3)" in streams.take("c")
    streams.release(a1)
    streams.release(a1)  # a second release of one stream counts nothing
    c = streams.take("c")
    assert isinstance(c, limits.Ticket) and streams.open == 3
    for ticket in (a2, b, c):
        streams.release(ticket)
    assert streams.open == 0 and not streams.by_peer and not streams.waiting


@pytest.mark.parametrize("held, new, evicted", [
    # held: (peer, whether its first frame came) in the order they came; new: the peer of the next stream
    ([("a", True), ("a", False), ("a", False)], "a", 2),  # over a's cap: a's newest silent stream gives way
    ([("a", True), ("a", True), ("a", False)], "a", 2),
    ([("a", True), ("a", True), ("a", True)], "a", None),  # none silent: refused
    ([("a", False), ("b", False), ("c", False), ("b", True), ("c", True)], "d", 0),  # over the total: the oldest
    ([("a", True), ("b", False), ("c", False), ("b", True), ("c", True)], "d", 1),
    ([("a", True), ("b", True), ("c", True), ("b", True), ("c", True)], "d", None),
    ([("b", False), ("a", True), ("a", True), ("a", True)], "a", None),  # another peer's silence is not a's room
])
def test_a_stream_over_a_cap_takes_the_place_of_one_that_sent_no_first_frame(held, new, evicted):
    streams, ended = limits.Streams(total=5, per_peer=3), []
    tickets = [streams.take(peer, lambda i=i: ended.append(i)) for i, (peer, _) in enumerate(held)]
    for ticket, (_, arrived) in zip(tickets, held):
        if arrived:
            streams.arrived(ticket)
    taken = streams.take(new)
    if evicted is None:
        assert isinstance(taken, str) and ended == [] and streams.open == len(held)
    else:
        assert isinstance(taken, limits.Ticket) and ended == [evicted] and streams.open == len(held)
        assert not tickets[evicted].open and streams.by_peer[new] >= 1


@pytest.mark.timeout(30)
def test_a_payload_buffer_grows_with_the_bytes_that_arrived_not_with_the_announced_length():
    async def main():
        reader = asyncio.StreamReader()
        channel = Channel(reader, None, "peer", stall=STALL)
        reader.feed_data(HEADER.pack(Kind.DATA, 2**30) + b"x" * 100)  # a GiB announced, 100 bytes sent
        tracemalloc.start()
        try:
            with pytest.raises(Closed):
                waiting = asyncio.ensure_future(channel.recv(2**30))
                await asyncio.sleep(0.05)
                reader.feed_eof()
                await waiting
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2**20, peak
    asyncio.run(main())


async def _victim(net: LoopbackNet, access: Access, names: list[str], stall: float = STALL):
    """A peer whose handlers each read a HELLO, then hold the stream until the peer closes it."""
    p2p = net.p2p()

    async def handler(channel: Channel) -> None:
        await channel.recv_control()
        handled.append(channel.peer)
        await channel.reader.read()  # until the peer closes
    handled: list = []
    for name in names:
        await serve(p2p, name, stall, handler, access)
    return p2p, handled


@pytest.mark.timeout(30)
def test_a_refused_peer_gets_fail_before_a_byte_of_its_stream_is_read():
    async def main():
        net, access = LoopbackNet(), Access()
        victim, handled = await _victim(net, access, ["h"])
        stranger = net.p2p()
        access.banned.add(str(stranger.peer_id))
        channel = await Channel.open(stranger, victim.peer_id, "h", STALL)
        with pytest.raises(PeerFailed, match="is banned"):
            await channel.recv(1024)  # nothing sent: the FAIL came before any read of ours
        await channel.send_control(Kind.HELLO, {})
        await asyncio.sleep(0.1)
        assert handled == []
        await net.close()
    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_trickling_peer_holds_few_streams_and_is_named_and_banned():
    """The `trickle` attack (hostile.py) against a peer's four handlers: TRICKLE_STREAMS streams on each, every
    one announcing the largest HELLO (4 MiB) and sending a byte of it per half stall. The victim holds at most
    MAX_STREAMS_PER_PEER of them at once (each buffering the bytes that arrived, not the 4 MiB announced: the
    test above), ends each after its first-frame deadline as an offense, bans the attacker after two and
    meanwhile still serves an honest peer."""
    async def main():
        net, access = LoopbackNet(), Access()
        names = ["ar", "ar_repair", "ar_audit", "state"]
        victim, handled = await _victim(net, access, names)
        attacker, honest = net.p2p(), net.p2p()
        reach = Reach(attacker, lambda what: what, STALL, lambda: [victim.peer_id.to_base58()])
        streams = limits.streams_of(victim)
        attack = asyncio.ensure_future(Attacker(["trickle"]).run(reach))
        try:
            most, start = 0, time.monotonic()  # sampled until the ban (its first streams end after 2 x STALL)
            while str(attacker.peer_id) not in access.banned and time.monotonic() - start < 10:
                most = max(most, streams.by_peer[str(attacker.peer_id)])
                await asyncio.sleep(0.02)
            for _ in range(25):  # and for half a second more, banned, while it keeps trying
                most = max(most, streams.by_peer[str(attacker.peer_id)])
                await asyncio.sleep(0.02)
            channel = await Channel.open(honest, victim.peer_id, "state", STALL)
            await channel.send_control(Kind.HELLO, {})
            await asyncio.sleep(0.1)
        finally:
            attack.cancel()
        assert 0 < most <= limits.MAX_STREAMS_PER_PEER < len(names) * TRICKLE_STREAMS
        assert str(attacker.peer_id) in access.banned
        named = {e["event"]: e["what"] for e in access.events if e["peer_id"] == str(attacker.peer_id)}
        assert "a trickle" in named["offense"] and "streams" in named
        assert handled == [honest.peer_id]  # the attacker's HELLOs never got through; the honest one did
        await net.close()
    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_trickler_s_own_hello_gets_through_its_full_cap():
    """A peer that holds its cap of streams at a groupmate, each still short of its first frame, and then opens
    the stream its all-reduce needs (HELLO in one write): that stream is served, in place of the newest silent
    one (noted as an event). When it was refused instead, the
    trickler's groups failed and its code blamed the groupmates that refused it (the hostile table's trickle
    row: an honest peer left out of a round)."""
    async def main():
        net, access = LoopbackNet(), Access()
        victim, handled = await _victim(net, access, ["ar"])
        peer = net.p2p()
        streams = limits.streams_of(victim)
        silent = [await Channel.open(peer, victim.peer_id, "ar", STALL) for _ in range(limits.MAX_STREAMS_PER_PEER)]
        for channel in silent:
            channel.writer.write(HEADER.pack(Kind.HELLO, 64))  # a header, and never the 64 bytes it announced
        while streams.by_peer[str(peer.peer_id)] < limits.MAX_STREAMS_PER_PEER:
            await asyncio.sleep(0.01)
        real = await Channel.open(peer, victim.peer_id, "ar", STALL)
        await real.send_control(Kind.HELLO, {})
        start = time.monotonic()
        while not handled and time.monotonic() - start < 5:
            await asyncio.sleep(0.01)
        assert handled == [peer.peer_id]
        named = [e["what"] for e in access.events if e["peer_id"] == str(peer.peer_id)]
        assert any("gave way to a newer one" in what for what in named), named
        for channel in [*silent, real]:
            channel.close()
        await net.close()
    asyncio.run(main())


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        before, after = limits.raise_open_files()
        assert before == lowered and resource.getrlimit(resource.RLIMIT_NOFILE)[0] == after
        assert after == (hard if hard != resource.RLIM_INFINITY else max(lowered, 2**20))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class SilentDHT:
    """A DHT whose reads and writes are never answered."""

    peer_id = "silent"

    def get(self, key, latest=False, return_future=False):
        return concurrent.futures.Future()

    def store(self, *args, return_future=False, **kwargs):
        return concurrent.futures.Future()


@pytest.mark.timeout(30)
def test_record_reads_end_after_the_live_window_and_decide_nothing():
    cfg = SwarmConfig(request_timeout=0.2, matchmaking_time=1.0, progress_interval=0.1)  # live window 0.9 s
    identity = load_identity(None)
    server = statesync.StateServer(None, "state", 1.0, None)
    records = Records(cfg, SilentDHT(), str(identity.peer_id), "p", identity.owner, Access(), Hooks(), server)
    start = time.monotonic()
    assert records.read_peers() is None and records.peers() == []
    assert records.assess(3, "").verdict is policy.Verdict.UNSURE
    assert time.monotonic() - start < 4 * 0.9 + 1.0


@pytest.mark.timeout(30)
def test_the_fingerprint_check_ends_after_bootstrap_timeout():
    cfg = SwarmConfig(bootstrap_timeout=0.2)
    start = time.monotonic()
    with pytest.raises(SwarmError, match="did not answer within 0.2 s"):
        dht_module.check_fingerprint(SilentDHT(), cfg, load_identity(None), "fp")
    assert time.monotonic() - start < 2.0


@pytest.mark.timeout(30)
def test_a_state_download_checks_the_donor_s_claim_off_the_network_loop():
    """`check` reads the DHT (blocking) in a real peer: it must run in the pool, never on the loop."""
    weights = torch.arange(12, dtype=torch.float32)
    sha = state_sha256(tensors_digest([weights]), 1)  # the state's hash: its tensors and its rounds closed
    snapshot = Snapshot(5, sha, {"round": 1, "step": 1}, {"global.0": weights}, 0, lambda: 0)
    target, accepted, checked_on = torch.zeros(12), [], []

    def check(round, got_sha):
        checked_on.append(threading.current_thread())
        time.sleep(0.2)  # a DHT read
        return None if (round, got_sha) == (5, sha) else "not what the swarm committed"

    async def main():
        net, pool = LoopbackNet(), concurrent.futures.ThreadPoolExecutor(2)
        donor, newcomer = net.p2p(), net.p2p()
        server = statesync.StateServer(donor, "state", STALL, pool)
        await server.start()
        server.snapshot = snapshot
        beats = 0

        async def heartbeat():  # the loop keeps running while the check blocks
            nonlocal beats
            while True:
                beats += 1
                await asyncio.sleep(0.02)
        beat = asyncio.ensure_future(heartbeat())
        intake = Intake(lambda specs: {"global.0": target}, lambda meta, round: accepted.append((meta, round)))
        got = await statesync.download(newcomer, donor.peer_id, "state", STALL, 1e6, intake, check, pool)
        beat.cancel()
        await net.close()
        pool.shutdown()
        return got, beats
    got, beats = asyncio.run(main())
    assert got.outer_step == 5 and torch.equal(target, weights) and accepted == [({"round": 1, "step": 1}, 5)]
    assert checked_on and checked_on[0] is not threading.main_thread() and beats >= 5


def _found(items):
    """A dictionary value as `dht.get(key, latest=True)` returns it: {subkey: (value, expiration)}."""
    return ValueWithExpiration({subkey: ValueWithExpiration(value, exp) for subkey, (value, exp) in items.items()},
                               max((exp for _, exp in items.values()), default=0.0))


def _commit(name: str = "p", at: float = 0.0, **fields) -> dict:
    return {"name": name, "round": 1, "sha256": "", "time": at, "work": 0, "statements": [], **fields}


def test_records_out_of_bounds_are_no_records():
    """Future-dated (beyond MAX_CLOCK_SKEW), expiring later than a writer may set, names over MAX_NAME: refused when
    read. And one owner gets one subkey: the schema refuses hivemind's looser `[owner:K]x[owner:K]`."""
    writer = load_identity(None)
    now, skew, life = time.time(), schema.MAX_CLOCK_SKEW, schema.RUN_RECORD_EXPIRATION
    cases = [  # (record, expiration, counts)
        (_commit(at=now), now + 60, True),
        (_commit(at=now + skew / 2), now + 60, True),  # a clock a little ahead
        (_commit(at=now + 2 * skew), now + 60, False),  # dated in the future: would look live for ever
        (_commit(at=now), now + life + 2 * skew, False),  # an expiration no peer sets
        (_commit(name="x" * (schema.MAX_NAME + 1), at=now), now + 60, False),
        (_commit(at=now), now - 1, False),  # expired
    ]
    for record, expiration, counts in cases:
        read = schema.read_owned(_found({writer.owner: (record, expiration)}), schema.CommitRecord, now)
        assert bool(read) == counts, (record, expiration - now)
    progress = schema.ProgressRecord(peer_id=str(writer.peer_id), name="p", round=1, inner_step=0, samples=0,
                                     samples_per_s=0.0, time=now, serves_state=True).dict()
    short = schema.read_owned(_found({writer.owner: (progress, now + 120)}), schema.ProgressRecord, now,
                              lifetime=30.0)
    assert short == {}  # progress records live progress_expiration, not a week

    validator = SchemaValidator(schema.RunSchema, allow_extra_keys=True, prefix="run")
    key = DHTID.generate(source=schema.commits_key("run")).to_bytes()

    def stored(subkey: bytes) -> bool:
        return validator.validate(DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(
            _commit(at=now)), now + 60))
    assert stored(writer.owner)
    assert not stored(writer.owner + b"x" + writer.owner)  # a second subkey of the same owner


@pytest.mark.timeout(30)
def test_a_drain_while_another_task_reads_takes_its_turn():
    """A failed group FAILs its streams to the owners (`Channel.refuse`, which drains them) while its exchange task
    may still read one: asyncio allows one reader per stream, and `drain` raised RuntimeError (hostile bench, `nan`
    row). Now the reader finishes its frame, then `drain` discards the rest."""
    async def main():
        reader = asyncio.StreamReader()
        channel = Channel(reader, None, "peer", stall=STALL)
        reading = asyncio.ensure_future(channel.recv(16))
        await asyncio.sleep(0.01)
        draining = asyncio.ensure_future(channel.drain())
        await asyncio.sleep(0.01)
        reader.feed_data(HEADER.pack(Kind.DATA, 3) + b"abc" + b"what the peer still sends")
        reader.feed_eof()
        assert await reading == (Kind.DATA, bytearray(b"abc"))
        await draining
        assert reader.at_eof()
    asyncio.run(main())
