"""A streamed butterfly all-reduce over raw libp2p streams whose result is bit-identical on every member.

Members are an ordered list of peer ids, the same on every member; member j owns part j of the wire vector
(`layout.py`), empty for a client (`swarm.client_mode`): only owners are ever dialed. Everything moves chunk
by chunk, so a member holds a few chunks at a time, never a vector:

1. Every member i opens one stream to every owner j != i and sends HELLO (group, weight: the one all agreed
   on), then its chunks of part j, read straight from the model's tensors and encoded (`Kind.CHUNK`).
2. Owner j decodes and checks each chunk as it arrives (exact length, finite; a bad one fails the part and
   names the sender: `AllReduceFailed.culprit`), reduces chunk k of all n members in fp32 in MEMBER ORDER
   once all have arrived (`robust.py`: the weighted mean, or a bounded-influence rule), encodes the average
   ONCE and sends those same bytes back on every stream (`Kind.RESULT`). It reads a member's chunk k only
   while k < (chunks every member has been sent) + WINDOW, so a fast sender cannot fill its memory.
3. Every member decodes the results into `out` (the outer step's gradient buffers) as they arrive. The
   owner decodes its own encoded bytes too, so all members end with identical tensors whatever the codec.
4. A member holding the whole average sends DONE on its streams. Until every groupmate is DONE (or gone),
   and at most `stall` seconds, it keeps its group: an owner still sends its part to slow members, and any
   member serves any part it holds to a groupmate that lost that part's owner (`repair.py`): an owner that
   died after serving some members no longer splits the group into committers and discarders. With
   `verify_parts`, members check the owners first, and DONE means "my audit passed" (`audit.py`).
5. With the members' keys (every peer's signed meta), owners sign a digest of the result they sent each member,
   members' DONEs carry those digests, and a member returns only once every owner found them alike: one result
   per part (`agree.py`), whatever an owner sends whom.

CPU work (reading, encoding, reducing, decoding, writing) runs in a thread pool; the event loop only moves
bytes. A part either has all n contributions or it fails: `run()` then raises `AllReduceFailed` on every
member that needs it, and no half-averaged `out` is ever used. Waits end: every read and write stalls out
after `stall` s without progress (`wire.py`), a member that never shows up fails the part `stall` s after the
last contribution arrived, and the whole run is bounded by `budget.transfer_deadline` of its bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from typing import Callable, Optional, Sequence

import torch
from hivemind.p2p import P2P, PeerID

from swarm.net import dataplane
from swarm.net.access import Access
from swarm.net.allreduce import agree, audit, evidence, hashing
from swarm.net.allreduce.groupstate import (
    CONCLUSIVE,
    PROOF,
    SEEN,
    TOLD,
    AllReduceFailed,
    Contribution,
    GroupState,
    check_weights,
)
from swarm.net.allreduce.hooks import AllReduceHooks
from swarm.net.allreduce.layout import Chunk, WireLayout, decode_into, gather, scatter
from swarm.net.allreduce.repair import repair, serve_repair
from swarm.net.allreduce.robust import Rule, reduce_chunk
from swarm.net.allreduce.slots import GroupSlots
from swarm.net.budget import transfer_deadline
from swarm.net.codec import CodecError
from swarm.net.dataplane import DataPlane, hosts_of
from swarm.net.identity import Identity
from swarm.net.tasks import cancel_all, together
from swarm.net.wire import Channel, Kind, PeerFailed, ProtocolError, Traffic, WireError, serve
from swarm.tensors import all_finite

logger = logging.getLogger(__name__)


class NotFinite(CodecError):
    """A contribution that decodes to NaN or Inf: no honest peer sends one (see `CONCLUSIVE`)."""


class AllReduce(GroupSlots):
    """Runs all-reduces among groups formed elsewhere; one instance per peer, stream handlers under `name`."""

    def __init__(self, p2p: P2P, name: str, stall: float, min_bandwidth: float,
                 pool: concurrent.futures.Executor, rule: Optional[Rule] = None, access: Optional[Access] = None,
                 hooks: Optional[AllReduceHooks] = None, identity: Optional[Identity] = None,
                 data_plane: Optional[DataPlane] = None):
        """`identity`: our key, to sign our part's digests (agree.py: one result per part); None: no agreement.
        `data_plane`: move the bulk bytes to direct TCP where groupmates can dial each other (dataplane.py)."""
        super().__init__(p2p, name, stall, pool, access or Access())
        self.identity, self.data_plane = identity, data_plane
        self._undialable: dict[PeerID, float] = {}  # owners we could not dial: until when we skip the data plane
        self.min_bandwidth, self.rule, self.hooks = min_bandwidth, rule or Rule(), hooks or AllReduceHooks()
        # fault injection from outside (`faults.kill_phase`): after a part was pushed
        self.on_pushed: Optional[Callable[[], None]] = None

    async def start(self) -> None:
        if self.data_plane is not None:
            await self.data_plane.start(hosts_of(await self.p2p.get_visible_maddrs()))
        await serve(self.p2p, self.name, self.stall, self._serve_contributions, self.access)
        await serve(self.p2p, f"{self.name}_repair", self.stall, lambda channel: serve_repair(self, channel),
                    self.access)
        await serve(self.p2p, f"{self.name}_audit", self.stall, lambda channel: audit.serve_audit(self, channel),
                    self.access)

    async def stop(self) -> None:
        for name in (self.name, f"{self.name}_repair", f"{self.name}_audit"):
            await self.p2p.remove_binary_stream_handler(name)
        if self.data_plane is not None:
            await self.data_plane.stop()

    def deadline(self, layout: WireLayout, me: int) -> float:
        """How long one all-reduce may take: its bytes (and the audit's) at swarm.min_bandwidth, plus stall."""
        chunk = layout.codec.wire_bytes(layout.chunk_elements)
        extra = audit.audit_bytes(layout.members, chunk) if self.rule.verify else 0
        extra += agree.wire_bytes(layout.members) if self.identity is not None else 0
        return transfer_deadline(layout.member_wire_bytes(me) + extra, self.stall, self.min_bandwidth)

    # ---- a member's run ---------------------------------------------------------------------------------

    async def run(self, group_id: bytes, members: Sequence[PeerID], layout: WireLayout,
                  contribution: Contribution, weights: Sequence[object],
                  keys: Optional[Sequence[bytes]] = None) -> Traffic:
        """Average `contribution` among `members` into `contribution.out`; AllReduceFailed otherwise.
        `weights`: every member's, as all members agreed (matchmaking); ours is `contribution.weight`.
        `keys`: every member's public key (its signed meta): then members agree on every part's bytes first."""
        me = list(members).index(self.p2p.peer_id)
        check_weights(members, weights, me, contribution.weight)
        contribution.out.restart()
        slot = self._groups.setdefault(group_id, asyncio.get_running_loop().create_future())
        if slot.done():
            raise AllReduceFailed(f"group {group_id.hex()[:8]} was already run here")
        group = GroupState(group_id, members, me, layout, contribution, weights, self.rule,
                           keys if self.identity is not None else None)
        slot.set_result(group)
        self.hooks.started(group)
        if group_id in self._abandoned and self._abandoned[group_id][0] in group.members:
            await group.fail("{} left the group: {}".format(*self._abandoned.pop(group_id)))
        tasks = [asyncio.ensure_future(self._reduce_own(group))]
        tasks += [asyncio.ensure_future(self._exchange(group, j)) for j in layout.owners if j != me]
        done = audit.start(self, group, tasks) if self.rule.verify else group.complete
        if group.agreeing:  # and every other owner agreed, and so did we as an owner: agree.py
            others = {j for j in layout.owners if j != me}
            done = (lambda base: lambda: base() and group.agreed >= others
                    and len(group.settled) == len(group.members))(done)
        deadline = self.deadline(layout, me)
        group.ends_at = asyncio.get_running_loop().time() + deadline
        watch = asyncio.ensure_future(group.wait_for(done, None, "all-reduce"))
        try:
            async with asyncio.timeout(deadline):
                pending = {watch, *tasks}
                while watch not in (done := (await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))[0]):
                    pending -= done
                    for task in done:
                        task.result()  # raises the first failure
                watch.result()
            self._linger(group, tasks)
            return group.traffic
        except BaseException as e:
            if isinstance(e, TimeoutError):
                missing = [j for j, (h, c) in enumerate(zip(group.have, group.chunks)) if h < len(c)]
                # the one we saw hold us up: a member whose contribution to our part is missing, else an owner
                first = group.pending.get(min(group.pending, default=-1), [])  # the chunk of our part we wait on
                late = [i for i, c in enumerate(first) if c is None and i != me] + [j for j in missing if j != me]
                e = AllReduceFailed(f"not done within {deadline:.0f} s (swarm.stall_timeout + "
                                    f"{layout.member_wire_bytes(me)} bytes / swarm.min_bandwidth); parts {missing} "
                                    f"incomplete", group.members[late[0]] if late else None, SEEN)
            elif isinstance(e, WireError):
                e = AllReduceFailed(str(e))
            cancel_all([watch, *tasks])  # before any await: a cancel of this run must not leave them running
            await group.fail(str(e) or type(e).__name__, getattr(e, "culprit", None), getattr(e, "blame", TOLD))
            if isinstance(e, AllReduceFailed) and e.culprit is None and group.culprit is not None:
                e = AllReduceFailed(f"{e} (first failure: {group.failure})", group.culprit, group.blame)
            self._forget(group_id, e if isinstance(e, AllReduceFailed) else group.failed())
            self.ended(group)
            self._tell_owners(group)
            if self.rule.verify:
                audit.keep(self, group)
            raise e from None

    def _encode_mine(self, group: GroupState, chunk: Chunk) -> bytes:
        """Our elements of `chunk`, encoded; with error feedback, what the encoding dropped goes to `residual`."""
        values = gather(group.mine.read, chunk)
        if self.hooks.checks_own() and not all_finite(values):
            raise AllReduceFailed("our own pseudo-gradient is not finite: not sent")
        codec = group.layout.codec_of(chunk)
        payload = codec.encode(self.hooks.contribution(values))
        if group.mine.residual is not None and codec.lossy:
            scatter(group.mine.residual, chunk, values - codec.decode(payload, chunk.numel))
        return payload

    async def _exchange(self, group: GroupState, j: int) -> None:
        """Push our chunks of part j to its owner and take its averages back; repair the part if the owner is lost."""
        channel = None
        try:
            channel = group.channels[j] = await self._open(group, j)
            await together(self._push(group, j, channel), self._take_results(group, j, channel))
        except PeerFailed as e:
            raise AllReduceFailed(f"part {j} failed at its owner: {e}", e.culprit, TOLD) from None
        except WireError as e:
            if group.failure is None:
                logger.info(f"all-reduce: lost the owner of part {j} ({e}); asking groupmates for it")
                await repair(self, group, j, e)
        await group.wait_for(lambda: (agree.ready(group) if group.agreeing else group.complete()) and group.audited,
                             None, "all-reduce")
        if channel is not None:
            try:
                await channel.send(Kind.DONE, agree.done_frame(group) if group.agreeing else b"")
                if group.agreeing:
                    await channel.recv_kind(Kind.DONE, 0)  # the owner found every member's digests alike
            except PeerFailed as e:
                raise AllReduceFailed(f"part {j}: its owner did not agree: {e}", e.culprit, TOLD) from None
            except WireError:
                pass  # the owner is gone; it needed nothing more from us, and cannot object any more
            channel.close()
        group.agreed.add(j)
        await group.notify()

    async def _open(self, group: GroupState, j: int) -> Channel:
        """Our stream to the owner of part j, HELLO sent: on the data plane if it offers one we can dial."""
        peer, now = group.members[j], asyncio.get_running_loop().time()
        channel = await Channel.open(self.p2p, peer, self.name, self.stall, group.traffic)
        asks = self.data_plane is not None and self._undialable.get(peer, 0.0) <= now
        await channel.send_control(Kind.HELLO, {"group": group.group_id, "weight": group.weights[group.me],
                                                **({"direct": True} if asks else {})})
        return await dataplane.switch(channel, self.stall, group.traffic, self._undialable) if asks else channel

    async def _push(self, group: GroupState, j: int, channel: Channel) -> None:
        signs = self.rule.verify and group.agreeing  # evidence.py: what we sent, signed, settles an audit
        pushed: list[bytes] = []  # digests of the chunks we sent, signed once all went (evidence.py)

        async def push(count: Optional[int]) -> None:  # the first `count` chunks of part j (None: all)
            chunks = group.chunks[j][:count]
            ahead = self.cpu(self._encode_mine, group, chunks[0]) if chunks else None
            for k in range(len(chunks)):
                payload = await ahead
                ahead = self.cpu(self._encode_mine, group, chunks[k + 1]) if k + 1 < len(chunks) else None
                await channel.send(Kind.CHUNK, payload)
                if signs:
                    pushed.append(audit.digest(payload))
        await self.hooks.push(group, j, channel, push)
        if signs and len(pushed) == len(group.chunks[j]):
            digests = b"".join(pushed)
            await channel.send(Kind.DIGEST, evidence.frame(digests, await self.cpu(evidence.sign, self.identity,
                                                                                     group, j, digests)))
        if self.on_pushed is not None:
            self.on_pushed()

    async def _take_results(self, group: GroupState, j: int, channel: Channel) -> None:
        await self.hooks.taking_results(group, j)
        committed = audit.DIGEST * len(group.members) if self.rule.verify else 0  # audit.py
        for chunk in group.chunks[j][group.have[j]:]:
            codec = group.layout.codec_of(chunk)
            payload = await channel.recv_kind(Kind.RESULT, committed + codec.wire_bytes(chunk.numel))
            group.hashes[j].update(payload)
            if committed:
                if group.audit_pick.get(j) == chunk.index:
                    group.audit_got[j] = (bytes(payload[:committed]), bytes(payload[committed:]))
                payload = payload[committed:]
            try:
                await self.cpu(decode_into, group.mine.out, chunk, codec, payload)
            except CodecError as e:
                raise AllReduceFailed(f"part {j}: bad average from {group.members[j]}: {e}", group.members[j]) from None
            group.have[j] += 1
            await group.notify()
        if group.agreeing:
            digest, sig = agree.parse_digest(await channel.recv_kind(Kind.DIGEST, agree.ENTRY_BYTES))
            if digest != group.hashes[j].digest() or not agree.verifies(group.keys[j], group.group_id, j, digest, sig):
                raise AllReduceFailed(f"part {j}: its owner {group.members[j]} sent a digest and signature that do "
                                      f"not match the bytes it sent us", group.members[j])
            group.signed[j] = (digest, sig)
            await group.notify()

    # ---- the owner's side -------------------------------------------------------------------------------

    def _reduce(self, group: GroupState, chunk: Chunk, contributions: list[torch.Tensor]) -> bytes:
        codec = group.layout.codec_of(chunk)
        average = self.hooks.average(reduce_chunk(contributions, group.shares, group.rule), chunk.index)
        if not all_finite(average):
            raise AllReduceFailed(f"part {group.me}: the average is not finite")
        payload = codec.encode(average)
        decode_into(group.mine.out, chunk, codec, payload)
        return payload

    def _own_share(self, group: GroupState, chunk: Chunk) -> tuple[torch.Tensor, bytes]:
        """Our chunk of our own part, with the rounding the other members' chunks get on the wire."""
        payload = self._encode_mine(group, chunk)
        try:
            return group.layout.codec_of(chunk).decode(payload, chunk.numel), payload
        except CodecError as e:  # only a peer that skipped its own check sends what it cannot decode: fail, not crash
            raise AllReduceFailed(f"part {group.me}: our own contribution does not decode: {e}") from None

    async def _reduce_own(self, group: GroupState) -> None:
        for k, chunk in enumerate(group.chunks[group.me]):
            own, payload = await self.cpu(self._own_share, group, chunk)
            group.pending.setdefault(k, [None] * len(group.members))[group.me] = own
            if self.rule.verify:
                group.digests.setdefault(k, [None] * len(group.members))[group.me] = audit.digest(payload)
            await group.notify()
            try:
                await group.wait_for(lambda k=k: all(c is not None for c in group.pending[k]), self.stall,
                                     f"part {group.me}, chunk {k}: waiting for "
                                     f"{[str(group.members[i]) for i, c in enumerate(group.pending[k]) if c is None]}")
            except AllReduceFailed as e:  # a member that never came, or went silent: we saw it ourselves
                missing = [group.members[i] for i, c in enumerate(group.pending[k]) if c is None]
                if e.culprit is not None or not missing:
                    raise
                raise AllReduceFailed(str(e), missing[0], SEEN) from None
            result = await self.cpu(self._reduce, group, chunk, group.pending.pop(k))
            group.results[k] = b"".join(group.digests.pop(k)) + result if self.rule.verify else result
            group.hashes[group.me].update(group.results[k])
            group.have[group.me] += 1
            await group.notify()
        if group.agreeing:
            digest = group.hashes[group.me].digest()
            group.signed[group.me] = (digest, await self.cpu(agree.sign, self.identity, group, digest))
            await group.notify()

    async def _serve_contributions(self, channel: Channel) -> None:
        """One member's stream to us, the owner of our part: its chunks in, our part's averages out."""
        if not self.access.admits(channel.peer):
            return await channel.refuse(self.access.refusal(channel.peer))
        try:
            hello = await channel.recv_control()
        except ProtocolError as e:  # no honest peer sends that: name it in the groups that wait for it
            for group in [g for g in map(self.held, list(self._groups)) if g and channel.peer in g.members
                          and g.members.index(channel.peer) not in g.hello]:
                await group.fail(f"part {group.me}: {channel.peer} sent an unreadable HELLO: {e}", channel.peer)
            await channel.refuse(f"an unreadable HELLO: {e}", channel.peer)
            raise
        if "abandon" in hello:
            return await self._left(hello.get("group"), channel.peer, hello["abandon"], hello.get("dropped"))
        group = await self._wait_group(hello.get("group"), channel)
        if group is None:
            return
        channel.count_into(group.traffic)
        i = group.members.index(channel.peer) if channel.peer in group.members else None
        weight = hello.get("weight")
        if i is None or i in group.hello:
            return await channel.refuse(f"{channel.peer} is not a groupmate that may push to us")
        group.hello.add(i)
        if weight != group.weights[i]:
            reason = f"part {group.me}: {channel.peer} sent weight {weight!r}, not the {group.weights[i]} it announced"
            logger.warning(f"all-reduce: rejected the contribution of {channel.peer}: bad weight {weight!r}")
            await group.fail(reason, channel.peer)
            return await channel.refuse(reason, channel.peer)
        stream, sending = channel, None
        try:
            try:
                if hello.get("direct") is True:
                    channel = await dataplane.answer(self.data_plane, stream, self.stall)
                    channel.count_into(group.traffic)
                sending = asyncio.ensure_future(self._send_results(group, i, channel))
                await self._take_contributions(group, i, channel)
                await sending
                if group.agreeing and i in group.vectors:
                    await agree.answer(group, channel)
            finally:
                if sending is not None:
                    cancel_all([sending])
                group.delivered[i] = math.inf
                group.settled.add(i)
                if i not in group.vectors:
                    group.gone.add(i)
                await group.notify()
            if group.failure is not None:  # our FAIL must reach it before we close (Channel.refuse)
                await channel.drain()
        finally:
            if channel is not stream:  # the data plane's connection (`serve` closes the stream)
                channel.close()

    async def _take_contributions(self, group: GroupState, i: int, channel: Channel) -> None:
        chunks = group.chunks[group.me]
        for k, chunk in enumerate(chunks):
            try:
                await group.wait_for(lambda k=k: k < group.window_end(), None, "window")
                codec = group.layout.codec_of(chunk)
                payload = await channel.recv_kind(Kind.CHUNK, codec.wire_bytes(chunk.numel))
                if self.rule.verify:
                    group.digests.setdefault(k, [None] * len(group.members))[i] = audit.digest(payload)
                    group.received.setdefault(i, []).append(group.digests[k][i])
                values = await self.cpu(codec.decode, payload, chunk.numel)
                if not all_finite(values):
                    raise NotFinite("part contains NaN or Inf")
            except PeerFailed as e:  # it gave up, naming whom it holds responsible
                await group.fail(f"part {group.me}: {e}", e.culprit, TOLD)
                return
            except (WireError, CodecError) as e:  # not finite: CONCLUSIVE; malformed: PROOF; silent or gone: SEEN
                if group.failure is None:
                    logger.warning(f"all-reduce: rejected the contribution of {channel.peer}: {e}")
                await group.fail(f"part {group.me}: rejected the contribution of {channel.peer}: {e}", channel.peer,
                                 CONCLUSIVE if isinstance(e, NotFinite) else
                                 PROOF if isinstance(e, (ProtocolError, CodecError)) else SEEN)
                return
            except AllReduceFailed:
                return
            group.pending.setdefault(k, [None] * len(group.members))[i] = values
            await group.notify()
        try:  # room for a FAIL's reason or, agreeing, for its digests; more than its part is refused
            if self.rule.verify and group.agreeing:  # its signature over what it sent us (evidence.py)
                evidence.check(group, i, await channel.recv_kind(Kind.DIGEST, agree.ENTRY_BYTES))
                await group.notify()
            done = await channel.recv_kind(Kind.DONE, agree.done_bytes(group) if group.agreeing else 512)
            if group.agreeing:
                await agree.take_done(group, i, done)
        except AllReduceFailed as e:
            await group.fail(str(e), e.culprit)
        except PeerFailed as e:  # with verify_parts: its audit failed (audit.py), so must the outer step
            await audit.refused(group, f"a groupmate refused the outer step: {e}", e.culprit)
        except ProtocolError as e:
            logger.warning(f"all-reduce: {channel.peer} sent more than its part: {e}")
        except WireError:
            pass  # it left: it needs nothing more from us

    async def _send_results(self, group: GroupState, i: int, channel: Channel) -> None:
        chunks = group.chunks[group.me]
        try:
            sent = hashing.Running()  # of what we send member i (agree.py)
            for k in range(len(chunks)):
                await group.wait_for(lambda k=k: group.have[group.me] > k, None, "results")
                await self.hooks.sending_result(group, i, k, channel)
                payload = self.hooks.result(group, i, k, group.results[k])
                sent.update(payload)
                await channel.send(Kind.RESULT, payload)
                group.delivered[i] = k + 1
                for done in [d for d in group.results if d < min(group.delivered)]:
                    del group.results[done]
                await group.notify()
            if group.agreeing:
                await group.wait_for(lambda: group.me in group.signed, None, "our digest")
                sig = await self.cpu(agree.sign, self.identity, group, digest := sent.digest())
                await channel.send(Kind.DIGEST, agree.digest_frame(digest, sig))
        except AllReduceFailed as e:
            await channel.fail(str(e), e.culprit)
        except WireError:
            pass  # member i is gone or stalled; it may still take our part from a groupmate
        finally:
            group.delivered[i] = math.inf
            await group.notify()
