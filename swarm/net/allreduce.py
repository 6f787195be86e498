"""A butterfly all-reduce over hivemind P2P whose result is bit-identical on every member.

Members are an ordered list of peer ids, the same on every member. The flat fp32 vector is cut into
n contiguous parts; member j owns part j.

1. Reduce-scatter: every member pushes part j of its vector (encoded by the codec) and its weight to
   member j (`{name}_push`). Member j decodes and validates each contribution (size, NaN/Inf, weight
   finite and >= 0); a bad one is rejected with a log line naming the sender and the part fails.
2. Member j sums the n contributions in fp32 in MEMBER ORDER, divides by the total weight, checks the
   result is finite and encodes it ONCE.
3. All-gather: every member (j included) fetches those same bytes (`{name}_fetch`) and decodes them,
   so all members end with identical tensors, whatever the codec's rounding.

A part either has all n contributions or it fails; any failed part (timeout, dead peer, rejected input)
makes `run()` raise `AllReduceFailed` on every member that sees it. There is no half-averaged result.

A push or fetch may arrive before this member has registered the group (it is still leaving
matchmaking). The handler then waits, for at most `timeout`, for the group to be registered: the
sender's data stays in the P2P stream meanwhile (bounded memory), at most `MAX_PENDING_GROUPS` unknown
groups are waited for, and a group is forgotten `timeout` seconds after it ended here.

`timeout` (cfg.allreduce_timeout) bounds the whole `run()`: a peer killed mid-round makes the survivors
fail after it instead of hanging (hivemind's own averager hangs for minutes without it).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Sequence

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.errors import SwarmError
from swarm.net.codec import Codec, CodecError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 2**20  # p2p messages are capped at 4 MiB; parts travel as a stream of 1 MiB chunks
MAX_PENDING_GROUPS = 16  # unknown group ids waited for at once; more are refused
OK, FAILED = averaging_pb2.AVERAGED_PART, averaging_pb2.INTERNAL_ERROR


class AllReduceFailed(SwarmError):
    """One all-reduce did not produce a complete result; `reason` says which part and why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class AllReduceResult:
    tensor: torch.Tensor  # the averaged flat vector, identical bytes on every member
    _group: _Group

    @property
    def bytes_sent(self) -> int:
        """Payload sent so far: grows after `run` returns while groupmates still fetch our part's result."""
        return self._group.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._group.bytes_received


def part_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """n contiguous [start, end) ranges covering numel elements, sizes differing by at most one."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for j in range(n):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class _Group:
    """This member's view of one all-reduce: its own part's contributions and encoded result."""

    def __init__(self, group_id: bytes, members: Sequence[PeerID], me: int, numel: int):
        self.group_id, self.members, self.me = group_id, list(members), me
        self.bounds = part_bounds(numel, len(members))
        start, end = self.bounds[me]
        self.part_numel = end - start
        self.contributions: list[Optional[tuple[torch.Tensor, float]]] = [None] * len(members)
        self.result: asyncio.Future[runtime_pb2.Tensor] = asyncio.get_running_loop().create_future()
        self.result.add_done_callback(lambda f: f.exception())  # a failure nobody fetched is not an error
        self.bytes_sent = self.bytes_received = 0
        self.served: set[int] = set()  # groupmates that fetched this member's result

    def settled(self) -> bool:
        """Failed, or every groupmate has fetched our part: nobody depends on this member any more."""
        if self.result.done() and self.result.exception() is not None:
            return True
        return self.served >= set(range(len(self.members))) - {self.me}

    def index_of(self, peer: PeerID) -> int:
        if peer not in self.members:
            raise CodecError(f"{peer} is not a member of this group")
        return self.members.index(peer)

    def fail(self, reason: str) -> None:
        if not self.result.done():
            self.result.set_exception(AllReduceFailed(reason))

    def accept(self, index: int, part: torch.Tensor, weight: float, codec: Codec) -> None:
        """Store a validated contribution; the last one completes the part (summed in member order)."""
        if self.contributions[index] is not None:
            raise CodecError("sent its part twice")
        self.contributions[index] = (part, weight)
        if self.result.done() or any(c is None for c in self.contributions):
            return
        total = math.fsum(w for _, w in self.contributions)
        if not total > 0:
            return self.fail(f"part {self.me}: total weight is {total}, must be > 0")
        acc = torch.zeros(self.part_numel, dtype=torch.float32)
        for tensor, w in self.contributions:
            acc.add_(tensor, alpha=w)
        acc.div_(total)
        self.contributions = [(torch.empty(0), w) for _, w in self.contributions]  # free memory, keep "done"
        if not torch.isfinite(acc).all():
            return self.fail(f"part {self.me}: the average is not finite")
        self.result.set_result(codec.encode(acc))


def _check(tensor: torch.Tensor, weight: float) -> None:
    if not (math.isfinite(weight) and weight >= 0):
        raise CodecError(f"weight {weight} is negative or not finite")
    if not torch.isfinite(tensor).all():
        raise CodecError("part contains NaN or Inf")


class AllReduce:
    """Runs all-reduces among groups formed elsewhere; one instance per peer, handlers under `name`."""

    def __init__(self, p2p: P2P, name: str, codec: Codec, timeout: float):
        self.p2p, self.name, self.codec, self.timeout = p2p, name, codec, timeout
        self.on_pushed: Optional[Callable[[], None]] = None  # fault injection: called after a part is delivered
        self._groups: dict[bytes, asyncio.Future[_Group]] = {}

    async def start(self) -> None:
        await self.p2p.add_protobuf_handler(f"{self.name}_push", self._rpc_push, averaging_pb2.AveragingData,
                                            stream_input=True)
        await self.p2p.add_protobuf_handler(f"{self.name}_fetch", self._rpc_fetch, averaging_pb2.AveragingData,
                                            stream_output=True)

    async def stop(self) -> None:
        await self.p2p.remove_protobuf_handler(f"{self.name}_push", stream_input=True)
        await self.p2p.remove_protobuf_handler(f"{self.name}_fetch", stream_output=True)

    async def run(self, group_id: bytes, members: Sequence[PeerID], flat: torch.Tensor,
                  weight: float) -> AllReduceResult:
        """Average `flat` (1-D fp32) with weight `weight` among `members`; raise AllReduceFailed otherwise."""
        slot = self._groups.setdefault(group_id, asyncio.get_running_loop().create_future())
        if slot.done():
            raise AllReduceFailed(f"group {group_id.hex()[:8]} was already run here")
        group = _Group(group_id, members, list(members).index(self.p2p.peer_id), flat.numel())
        slot.set_result(group)
        try:
            tensor = await asyncio.wait_for(self._run(group, flat, weight), self.timeout)
            return AllReduceResult(tensor, group)
        except TimeoutError:
            missing = [str(m) for m, c in zip(group.members, group.contributions) if c is None]
            raise AllReduceFailed(f"timed out after {self.timeout:g} s (swarm.allreduce_timeout); "
                                  f"own part still missing {missing or 'nothing'}") from None
        finally:
            group.fail("the owner of this part gave up on the all-reduce")
            asyncio.get_running_loop().call_later(self.timeout, self._groups.pop, group_id, None)

    async def _run(self, group: _Group, flat: torch.Tensor, weight: float) -> torch.Tensor:
        encoded = [self.codec.encode(flat[s:e]) for s, e in group.bounds]
        own = self.codec.decode(encoded[group.me], group.part_numel)  # own share takes the same rounding
        group.accept(group.me, own, float(weight), self.codec)
        jobs = [self._push(group, j, encoded[j], weight) for j in range(len(group.members)) if j != group.me]
        fetches = [asyncio.ensure_future(self._fetch(group, j)) for j in range(len(group.members))]
        tasks = [asyncio.ensure_future(job) for job in jobs] + fetches
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises the first failure
            return torch.cat([task.result() for task in fetches])
        finally:
            for task in tasks:
                task.cancel()

    async def _push(self, group: _Group, j: int, msg: runtime_pb2.Tensor, weight: float) -> None:
        peer = group.members[j]
        chunks = list(split_for_streaming(msg, CHUNK_BYTES))
        group.bytes_sent += sum(c.ByteSize() for c in chunks)

        async def requests() -> AsyncIterator[averaging_pb2.AveragingData]:
            for i, chunk in enumerate(chunks):
                yield averaging_pb2.AveragingData(group_id=group.group_id if i == 0 else b"", tensor_part=chunk,
                                                  weight=weight if i == 0 else 0.0)

        try:
            reply = await self.p2p.call_protobuf_handler(peer, f"{self.name}_push", requests(),
                                                         averaging_pb2.AveragingData)
        except Exception as e:  # P2PHandlerError, P2PDaemonError, ConnectionError, StopAsyncIteration...
            raise AllReduceFailed(f"part {j}: cannot send it to {peer}: {e!r}") from e
        if reply.code != OK:
            raise AllReduceFailed(f"part {j}: {peer} refused our contribution "
                                  f"({averaging_pb2.MessageCode.Name(reply.code)})")
        if self.on_pushed is not None:
            self.on_pushed()

    async def _fetch(self, group: _Group, j: int) -> torch.Tensor:
        peer, (start, end) = group.members[j], group.bounds[j]
        if j == group.me:
            msg = await asyncio.shield(group.result)
        else:
            try:
                stream = await self.p2p.iterate_protobuf_handler(
                    peer, f"{self.name}_fetch", averaging_pb2.AveragingData(group_id=group.group_id),
                    averaging_pb2.AveragingData)
                replies = [reply async for reply in stream]
            except Exception as e:  # as in _push: any transport failure fails the part
                raise AllReduceFailed(f"part {j}: cannot fetch it from {peer}: {e!r}") from e
            if not replies:
                raise AllReduceFailed(f"part {j}: its owner {peer} closed the stream without an answer")
            if any(r.code != OK for r in replies):
                raise AllReduceFailed(f"part {j}: its owner {peer} reports it failed")
            group.bytes_received += sum(r.tensor_part.ByteSize() for r in replies)
            msg = combine_from_streaming(r.tensor_part for r in replies)
        try:
            part = self.codec.decode(msg, end - start)
            _check(part, 1.0)
        except CodecError as e:
            raise AllReduceFailed(f"part {j}: bad average from {peer}: {e}") from None
        return part

    async def _wait_group(self, group_id: bytes) -> _Group:
        slot = self._groups.get(group_id)
        if slot is None:
            if sum(not f.done() for f in self._groups.values()) >= MAX_PENDING_GROUPS:
                raise CodecError("too many unknown groups pending")
            slot = self._groups[group_id] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(slot), self.timeout)
        except TimeoutError:
            if self._groups.get(group_id) is slot and not slot.done():
                del self._groups[group_id]
            raise CodecError(f"group {group_id.hex()[:8]} never started here") from None

    async def _rpc_push(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                        context: P2PContext) -> averaging_pb2.AveragingData:
        sender, group = context.remote_id, None
        try:
            first = await anext(stream)
            group = await self._wait_group(first.group_id)
            index = group.index_of(sender)
            limit = group.part_numel * self.codec.bytes_per_element + CHUNK_BYTES
            chunks, size = [first.tensor_part], first.tensor_part.ByteSize()
            async for message in stream:
                chunks.append(message.tensor_part)
                size += message.tensor_part.ByteSize()
                if size > limit:
                    raise CodecError(f"sent more than {limit} bytes")
            group.bytes_received += size
            part = self.codec.decode(combine_from_streaming(chunks), group.part_numel)
            _check(part, first.weight)
            group.accept(index, part, first.weight, self.codec)
            return averaging_pb2.AveragingData(code=OK)
        except (CodecError, StopAsyncIteration) as e:
            logger.warning(f"all-reduce: rejected the contribution of {sender}: {e}")
            if group is not None:
                group.fail(f"part {group.me}: rejected the contribution of {sender}: {e}")
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)

    async def _rpc_fetch(self, request: averaging_pb2.AveragingData,
                         context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        try:
            group = await self._wait_group(request.group_id)
            index = group.index_of(context.remote_id)
            msg = await asyncio.wait_for(asyncio.shield(group.result), self.timeout)
        except (TimeoutError, CodecError, AllReduceFailed) as e:
            logger.debug(f"all-reduce: no result for {context.remote_id}: {e!r}")
            yield averaging_pb2.AveragingData(code=FAILED)
            return
        for chunk in split_for_streaming(msg, CHUNK_BYTES):
            group.bytes_sent += chunk.ByteSize()
            yield averaging_pb2.AveragingData(code=OK, tensor_part=chunk)
        group.served.add(index)

    async def drain(self) -> list[bytes]:
        """Wait (at most `timeout`) until every group run here is settled; return the ids still unsettled.

        A member that leaves right after its last all-reduce would otherwise take its part with it: a
        groupmate still fetching that part fails the round that this member already committed.
        """
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            pending = [gid for gid, slot in self._groups.items()
                       if slot.done() and not slot.exception() and not slot.result().settled()]
            if not pending or asyncio.get_running_loop().time() >= deadline:
                return pending
            await asyncio.sleep(0.05)
