"""`swarm.verify_parts`: every member checks every other part's owner on one chunk it picked in secret.

The reduce is deterministic (robust.py): the same contributions and shares give the same bytes on any
member. So an owner cannot return a wrong average for a chunk without every member that recomputes that
chunk noticing:

1. With each result chunk k the owner sends, before the average, a 16-byte BLAKE3 digest (hashing.py) of every
   member's contribution to k as it received it (its commitment, made before anyone says which chunk it
   checks).
2. Member m picked, when the group formed, one chunk of each other part at random (`secrets`). Once it holds
   the whole average, it fetches that chunk's contribution from every member (`serve_audit`: a member
   encodes it again from its tensors; codecs are deterministic, so these are the bytes it sent), and
   - a digest of its own contribution that differs: the owner misreported it -> culprit: the owner;
   - another member's digest that differs: that member or the owner lies; m cannot tell which, so the
     outer step fails with no culprit;
   - the recomputed average's bytes differ from the owner's: "part j: owner X returned a wrong average"
     -> culprit: the owner.
3. A member sends DONE to the owners only once its audit passed, FAIL otherwise; with verify_parts every
   member returns from the all-reduce only after every groupmate sent DONE (or left): one member's
   detection fails the outer step for all, none commits a wrong average.

Detection: an owner that falsifies c of the K chunks of its part passes one auditor with probability
1 - c/K, so the n-1 auditors catch it with probability 1 - (1 - c/K)^(n-1): 1 if it falsifies every chunk
(the way to dictate the average), 1 - (1 - 1/K)^(n-1) ~ (n-1)/K for one chunk (8 members, K = 40 chunks
of a 10M-element part: 16 %).

Each member checks the bytes it received: an owner that sends one member a falsified chunk and the
others the true one is caught by that member alone, with probability 1/K if it falsifies one chunk; the
agreement on signed digests (agree.py, on whenever members' keys are known) catches that one with
certainty, whatever it falsifies. What the audit still adds is the owner that sends every member the same
wrong average (the way to dictate the part): the digests agree then, and only a recomputation sees it.

Cost per member and outer step: (n-1)^2 contribution chunks fetched (n-1 parts, each from the n-1 others, the
owner included) and as many served, n-1 chunks recomputed, 16 n bytes of digests per result chunk. Against
the all-reduce's 2 (n-1)/n V: measured +26 % received at 3M fp32 elements and n = 3 (4 chunks of 1 MiB on
16 MB), and by the formula +5 % for a 150M-parameter fp32 model at n = 8, +11 % for 1.1B at n = 32 (it
grows as n^2 chunks against V). Not covered: a part taken from a groupmate after its owner was lost
(repair.py: no digests, not audited); a contributor that does not answer the fetch (that part goes
unchecked, logged); and a CPU whose float rounding differs (a false alarm, the outer step retried).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Callable, Optional

from hivemind.p2p import PeerID

from swarm.net.allreduce import evidence
from swarm.net.allreduce.groupstate import TOLD, AllReduceFailed, GroupState
from swarm.net.allreduce.hashing import DIGEST, digest
from swarm.net.allreduce.layout import gather
from swarm.net.allreduce.robust import reduce_chunk
from swarm.net.allreduce.slots import GroupSlots
from swarm.net.codec import CodecError
from swarm.net.wire import Channel, Closed, Kind, ProtocolError, WireError
from swarm.tensors import all_finite

logger = logging.getLogger("swarm.net.allreduce")  # one log for the whole all-reduce

__all__ = ["DIGEST", "digest"]  # the chunk digests the audit commits to, for the all-reduce


def start(slots: GroupSlots, group: GroupState, tasks: list) -> Callable[[], bool]:
    """Pick the chunk of every other part we will recompute (now, told to nobody), add our audit to the run's
    `tasks`; return when the run is done: complete, our audit passed, every groupmate said DONE (or left)."""
    group.audit_pick = {j: secrets.randbelow(len(c)) for j, c in enumerate(group.chunks) if j != group.me and c}
    tasks.append(asyncio.ensure_future(audit(slots, group)))
    if group.me in group.layout.clients:  # nobody can dial us: we take our contributions to the auditors
        tasks += [asyncio.ensure_future(offer(slots, group, m)) for m in group.layout.owners]
    return lambda: group.complete() and group.audited and len(group.settled) == len(group.members)


def audit_bytes(group_size: int, chunk_bytes: int) -> int:
    """Bytes one member fetches for its audits (and serves to the others'): the deadline counts them."""
    return (group_size - 1) ** 2 * chunk_bytes


def encode_pure(group: GroupState, chunk) -> bytes:
    """Our contribution to `chunk` as we sent it (the codec is deterministic; no error feedback here)."""
    return group.layout.codec_of(chunk).encode(gather(group.mine.read, chunk))


async def fetch(slots: GroupSlots, group: GroupState, i: int, j: int, k: int) -> Optional[bytes]:
    """Member i's contribution to chunk k of part j; None if it is gone (that part goes unchecked). A client is
    asked on the stream it opened to us (`offer`), anyone else on a stream we open."""
    chunk = group.chunks[j][k]
    client = i in group.layout.clients
    try:
        if not client:
            channel = await Channel.open(slots.p2p, group.members[i], f"{slots.name}_audit", slots.stall,
                                         group.traffic)
        elif (channel := await offered(slots, group, i)) is None:
            return None
        try:
            await channel.send_control(Kind.HELLO, {"group": group.group_id, "part": j, "chunk": k})
            return bytes(await channel.recv_kind(Kind.CHUNK, group.layout.codec_of(chunk).wire_bytes(chunk.numel)))
        finally:
            if not client:
                channel.close()
    except ProtocolError as e:
        raise AllReduceFailed(f"part {j}: {group.members[i]} sent a malformed contribution for the audit: {e}",
                              group.members[i]) from None
    except WireError as e:
        logger.warning(f"all-reduce: cannot audit part {j}: {group.members[i]} did not send its contribution: {e}")
        return None


async def offered(slots: GroupSlots, group: GroupState, i: int) -> Optional[Channel]:
    """The stream client i opened to answer our audits. It opens it once it holds the whole average, before its
    DONE (which waits for its own audit): so we wait for it until then and `stall` s more, within the run's
    deadline. None if it never came, or if we are a client too (neither of us can dial the other)."""
    if group.me in group.layout.clients:
        logger.info(f"all-reduce: cannot audit the parts {group.members[i]} contributed to: it is a client, "
                    f"and so are we")
        return None
    stream = group.offers.setdefault(i, asyncio.get_running_loop().create_future())
    try:
        async with asyncio.timeout_at(group.ends_at):
            await group.wait_for(lambda: stream.done() or i in group.settled, None, "audit")
            async with asyncio.timeout(slots.stall):
                return await asyncio.shield(stream)
    except TimeoutError:
        logger.warning(f"all-reduce: cannot audit: client {group.members[i]} did not bring its contributions")
        return None


def is_chunk(group: GroupState, j: object, k: object) -> bool:
    """Whether an audit request's (part, chunk), read off the wire, names a chunk of this group."""
    return (isinstance(j, int) and 0 <= j < len(group.members) and isinstance(k, int)
            and 0 <= k < len(group.chunks[j]))


async def offer(slots: GroupSlots, group: GroupState, m: int) -> None:
    """We are a client: once we hold the whole average, open a stream to auditor m (an owner) and answer its
    requests, one chunk of each part it checks (not its own), until it closes the stream (its audit is over).
    What m does wrong here ends this stream only: m's audit then leaves our contributions unchecked."""
    await group.wait_for(group.complete, None, "audit offer")
    loop, asked = asyncio.get_running_loop(), set()
    try:
        channel = await Channel.open(slots.p2p, group.members[m], f"{slots.name}_audit", slots.stall, group.traffic)
        try:
            await channel.send_control(Kind.HELLO, {"group": group.group_id, "offer": True})
            while True:
                channel.stall = max(slots.stall, group.ends_at - loop.time())  # m asks once it holds the average
                try:
                    request = await channel.recv_control()
                except Closed:
                    return  # m's audit is over
                channel.stall = slots.stall
                j, k = request.get("part"), request.get("chunk")
                if not (is_chunk(group, j, k) and j != m and j not in asked):
                    raise ProtocolError(f"{channel.peer} asked for chunk {k!r} of part {j!r} for its audit")
                asked.add(j)
                payload = await slots.cpu(encode_pure, group, group.chunks[j][k])
                await channel.send(Kind.CHUNK, slots.hooks.audited(payload))
        finally:
            channel.close()
    except WireError as e:
        logger.info(f"all-reduce: the audit of {group.members[m]} gets no more of our contributions: {e}")


async def take_offer(group: Optional[GroupState], channel: Channel) -> None:
    """A client of `group` opened `channel` to answer our audit (`offer`): hand it to `fetch`, and keep it open
    until our audit is over."""
    i = group.members.index(channel.peer) if group is not None and channel.peer in group.members else None
    if (i is None or not group.rule.verify or group.failure is not None or i not in group.layout.clients
            or group.me in group.layout.clients or ((f := group.offers.get(i)) is not None and f.done())):
        return await channel.fail("no such group here, not a client of it, or offered already")
    channel.count_into(group.traffic)
    group.offers.setdefault(i, asyncio.get_running_loop().create_future()).set_result(channel)
    await group.notify()
    try:
        async with asyncio.timeout_at(group.ends_at):
            await group.wait_for(lambda: group.audited, None, "audit")
    except (TimeoutError, AllReduceFailed):
        return  # our audit or our outer step ended without passing: run() says why; this stream just closes


async def check_part(slots: GroupSlots, group: GroupState, j: int) -> None:
    k, (committed, result) = group.audit_pick[j], group.audit_got.pop(j)
    owner, chunk, n = group.members[j], group.chunks[j][group.audit_pick[j]], len(group.members)
    codec = group.layout.codec_of(chunk)
    fetched = await asyncio.gather(*[fetch(slots, group, i, j, k) for i in range(n) if i != group.me])
    payloads = fetched[:group.me] + [await slots.cpu(encode_pure, group, chunk)] + fetched[group.me:]
    if any(p is None for p in payloads):
        return
    for i, payload in enumerate(payloads):
        if digest(payload) != committed[i * DIGEST:(i + 1) * DIGEST]:
            if i == group.me:
                raise AllReduceFailed(f"part {j}: owner {owner} misreported our contribution to chunk {k}", owner)
            if i == j:  # both sides of it are the owner's own word
                raise AllReduceFailed(f"part {j}: owner {owner} answered our audit of its own chunk {k} with other "
                                      f"bytes than it committed", owner)
            if group.agreeing:  # the member's signature over what it sent tells who lies (evidence.py)
                raise await evidence.settle(slots, group, i, j, k, committed[i * DIGEST:(i + 1) * DIGEST])
            raise AllReduceFailed(f"part {j}: owner {owner} and {group.members[i]} disagree on what "
                                  f"{group.members[i]} sent for chunk {k} (one of them lies)")

    def recompute() -> bytes:
        values = [codec.decode(p, chunk.numel) for p in payloads]
        if not all(all_finite(v) for v in values):
            raise CodecError("a contribution the owner accepted is not finite")
        return codec.encode(reduce_chunk(values, group.shares, group.rule))
    try:
        expected = await slots.cpu(recompute)
    except CodecError as e:
        raise AllReduceFailed(f"part {j}: owner {owner} accepted a contribution it had to refuse: {e}", owner) from None
    if expected != result:
        raise AllReduceFailed(f"part {j}: owner {owner} returned a wrong average (chunk {k} differs from its "
                              f"recomputation)", owner)


async def audit(slots: GroupSlots, group: GroupState) -> None:
    """Check every part we took from its owner; on a failure tell every owner (FAIL) before anything else.
    A groupmate's failed audit fails the outer step only after ours is done: our own finding names the culprit,
    a groupmate's word never does."""
    await group.wait_for(group.complete, None, "audit")
    try:
        for j in sorted(group.audit_got):
            await check_part(slots, group, j)
        if group.refusals:
            raise AllReduceFailed(*group.refusals[0], TOLD)
    except AllReduceFailed as e:
        if e.culprit is not None:
            logger.warning(f"all-reduce: audit failed: {e}")
        await group.fail(str(e), e.culprit)
        await asyncio.gather(*[channel.fail(str(e), e.culprit) for channel in group.channels.values()])
        raise
    group.audited = True
    await group.notify()


async def refused(group: GroupState, reason: str, culprit: Optional[PeerID]) -> None:
    """A groupmate's audit (or its outer step) failed: it sent FAIL where DONE was due, naming `culprit`."""
    if group.audited or not group.rule.verify:
        await group.fail(reason, culprit, TOLD)
    else:
        group.refusals.append((reason, culprit))


def keep(slots: GroupSlots, group: GroupState) -> None:
    """Serve a failed group's contributions to auditors for `stall` s more: a groupmate still checking the
    owner we caught needs them to find the culprit itself."""
    group.pending.clear()
    group.results.clear()
    slots.keep_failed(group)


async def serve_audit(slots: GroupSlots, channel: Channel) -> None:
    """Send a groupmate our contribution to one chunk of one part (each member may ask once per part)."""
    hello = await channel.recv_control()
    group_id = hello.get("group")
    group = slots.held(group_id, failed=True)
    if hello.get("offer") is True:
        return await take_offer(group, channel)
    if "evidence" in hello:
        if group is None or channel.peer not in group.members or hello.get("part") != group.me:
            return await channel.fail("no such group or part here")
        return await evidence.serve(group, channel, hello["evidence"], slots.stall)
    j, k = hello.get("part"), hello.get("chunk")
    valid = (group is not None and group.rule.verify and channel.peer in group.members and is_chunk(group, j, k)
             and (channel.peer, j) not in group.audits_served)
    if not valid:
        return await channel.fail("no such group, part or chunk here, or asked already")
    group.audits_served.add((channel.peer, j))
    channel.count_into(group.traffic)
    await channel.send(Kind.CHUNK, slots.hooks.audited(await slots.cpu(encode_pure, group, group.chunks[j][k])))
