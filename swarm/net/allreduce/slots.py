"""The groups one peer runs or waits for, by group id: the part of `AllReduce` that strangers reach first,
and what its audits and repairs (audit.py, repair.py) use of it: the peer's P2P, handler name, stall, access
and CPU pool.

A groupmate may push to us before we have left matchmaking, so a stream naming an unknown group waits for
it up to `stall` s; at most MAX_PENDING_GROUPS such waits at once, and MAX_PENDING_PER_PEER per peer, so
that one peer opening streams for made-up groups (a flood) leaves room for every other groupmate. A
complete group lingers until its groupmates are settled, at most `stall` s (`_linger`; `drain` waits for those
that linger); a finished or failed group is remembered `stall` s more, so late streams naming it get its fate at
once; a member that leaves a group before running it (`abandon`) is remembered as long, and so is whom it named
as left out of it (`regroup`: grouping.adopted decides on them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections import Counter
from typing import Callable, Optional, Sequence

from hivemind.p2p import P2P, PeerID

from swarm.net.access import Access
from swarm.net.allreduce.groupstate import AllReduceFailed, GroupState, subgroup_id
from swarm.net.tasks import cancel_all, keep
from swarm.net.wire import Channel, Kind, WireError

logger = logging.getLogger(__name__)

MAX_PENDING_GROUPS = 16  # unknown group ids waited for at once; more are refused
MAX_PENDING_PER_PEER = 2  # of those, opened by one peer: a flood from one peer leaves room for the others
MAX_NAMED = 256  # members one abandon may name as left out, and abandons kept per group: strangers send them


class GroupSlots:
    def __init__(self, p2p: P2P, name: str, stall: float, pool: concurrent.futures.Executor, access: Access):
        self.p2p, self.name, self.stall, self.pool, self.access = p2p, name, stall, pool, access
        self._groups: dict[bytes, asyncio.Future[GroupState]] = {}
        self._abandoned: dict[bytes, tuple[PeerID, str]] = {}  # groups a member left before we ran them
        # by group: each member that left it for a group without some members, and whom it left out
        self._left_outs: dict[bytes, dict[str, frozenset[str]]] = {}
        self._told = asyncio.Condition()  # notified on every abandon received
        self._ended: dict[bytes, list[PeerID]] = {}  # groups that failed here: their dialable members
        self._regrouped: dict[bytes, Optional[frozenset[str]]] = {}  # what `regroup` chose for them
        self._opened: Counter[PeerID] = Counter()  # unknown groups each peer is waiting for here
        self._failed: dict[bytes, GroupState] = {}  # verify_parts: failed groups, `stall` s for audits (audit.py)
        self._serving: set[asyncio.Task] = set()  # lingering groups, FAILs being delivered: `drain` waits for them

    def cpu(self, fn, *args) -> asyncio.Future:
        """`fn(*args)` in the CPU pool: the event loop only moves bytes."""
        return asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _background(self, coro) -> None:
        keep(asyncio.ensure_future(coro), self._serving)

    def _linger(self, group: GroupState, tasks: list[asyncio.Task]) -> None:
        """Keep a complete group (and its `out`) for groupmates until all are settled, at most `stall` s."""
        async def release() -> None:
            try:
                await group.wait_for(lambda: len(group.settled) == len(group.members), self.stall, "linger")
            except AllReduceFailed:
                pass  # a groupmate that neither finished nor left within stall: it has no claim on us any more
            finally:
                cancel_all(tasks)
                self._forget(group.group_id, AllReduceFailed("this all-reduce is over here"))
        self._background(release())

    async def drain(self) -> int:
        """Wait until every complete group has been left by its groupmates (each at most `stall` s); return
        how many were still held. A member leaving right after its last outer step still serves it meanwhile."""
        pending = list(self._serving)
        if pending:
            await asyncio.wait(pending)
        return len(pending)

    def _tell_owners(self, group: GroupState) -> None:
        """A failed group: FAIL our streams to the owners, naming the culprit, so that they name it too instead
        of waiting out our silence (in the background: each waits for its owner to close, `Channel.refuse`)."""
        async def tell(channel: Channel) -> None:
            await channel.refuse(group.failure or "failed", group.culprit)
            channel.close()
        for channel in group.channels.values():
            self._background(tell(channel))

    def held(self, group_id: object, failed: bool = False) -> Optional[GroupState]:
        """The group `group_id` if it runs (or lingers) here; with `failed`, also one kept for audits."""
        slot = self._groups.get(group_id) if isinstance(group_id, bytes) else None
        if slot is not None and slot.done() and slot.exception() is None:
            return slot.result()
        return self._failed.get(group_id) if failed and isinstance(group_id, bytes) else None

    def keep_failed(self, group: GroupState) -> None:
        """Hold a failed group `stall` s more, for `held(..., failed=True)`: its groupmates' audits need it."""
        self._failed[group.group_id] = group
        asyncio.get_running_loop().call_later(self.stall, self._failed.pop, group.group_id, None)

    async def abandon(self, group_id: bytes, members: Sequence[PeerID], reason: str,
                      dropped: Sequence[str] = ()) -> None:
        """Tell `members` that we will not take part in `group_id` (they drop it at once, not after a stall);
        `dropped`: the members we left out of it, for the group we run instead (grouping.without)."""
        hello = {"group": group_id, "abandon": reason[:300], **({"dropped": sorted(dropped)} if dropped else {})}

        async def tell(peer: PeerID) -> None:
            try:
                channel = await Channel.open(self.p2p, peer, self.name, self.stall)
                await channel.send_control(Kind.HELLO, hello)
                channel.close()
            except WireError as e:
                logger.debug(f"all-reduce: could not tell {peer} that we left group {group_id.hex()[:8]}: {e}")
        await asyncio.gather(*[tell(p) for p in members if p != self.p2p.peer_id])

    async def _left(self, group_id: object, peer: PeerID, reason: object, dropped: object) -> None:
        """A member left a group (its matchmaking barrier failed, or it left members out): fail the group if it
        is ours, or remember it for `stall` s in case we have yet to run it; whom it left out, as long."""
        if not isinstance(group_id, bytes):
            return
        if (isinstance(dropped, list) and 0 < len(dropped) <= MAX_NAMED and all(isinstance(d, str) for d in dropped)
                and (len(self._left_outs.get(group_id, ())) < MAX_NAMED if group_id in self._left_outs
                     else len(self._left_outs) < MAX_PENDING_GROUPS)):
            if group_id not in self._left_outs:
                self._left_outs[group_id] = {}
                asyncio.get_running_loop().call_later(self.stall, self._left_outs.pop, group_id, None)
            self._left_outs[group_id][str(peer)] = named = frozenset(dropped)
            if group_id in self._regrouped and named != self._regrouped[group_id]:
                self._decline(group_id, named)  # it came after we chose
            async with self._told:
                self._told.notify_all()
        group = self.held(group_id)
        if group is not None and peer in group.members:
            await group.fail(f"{peer} left the group: {str(reason)[:300]}")
        elif group is None and len(self._abandoned) < MAX_PENDING_GROUPS:
            self._abandoned[group_id] = (peer, str(reason)[:300])
            asyncio.get_running_loop().call_later(self.stall, self._abandoned.pop, group_id, None)

    def ended(self, group: GroupState) -> None:
        """`group` failed here: a member that left it for a group without some members may still tell us so."""
        self._ended[group.group_id] = [p for i, p in enumerate(group.members) if i not in group.layout.clients]
        asyncio.get_running_loop().call_later(self.stall, self._ended.pop, group.group_id, None)

    async def regroup(self, group_id: bytes, choose: Callable[[dict[str, frozenset[str]]], Optional[frozenset[str]]],
                      timeout: float) -> Optional[frozenset[str]]:
        """After group `group_id` failed here: the members to drop from it that `choose` picks from whom the
        members that left it left out (grouping.adopted), waiting for them at most `timeout` s while some members
        said nothing yet; None: none. Every other set they name (ours apart), now or later, is declined: we leave
        the group without it at once, so that its members do not wait for us."""
        others = {str(p) for p in self._ended.get(group_id, ())} - {str(self.p2p.peer_id)}
        named = lambda: self._left_outs.get(group_id, {})  # noqa: E731
        async with self._told:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._told.wait_for(
                    lambda: not named() or set(named()) >= others or choose(named()) is not None), timeout)
            chosen = self._regrouped[group_id] = choose(named())
        asyncio.get_running_loop().call_later(self.stall, self._regrouped.pop, group_id, None)
        for dropped in set(named().values()) - {chosen}:
            self._decline(group_id, dropped)
        return chosen

    def _decline(self, group_id: bytes, dropped: frozenset[str]) -> None:
        members = self._ended.get(group_id)
        if members is None or str(self.p2p.peer_id) in dropped:
            return
        self._background(self.abandon(subgroup_id(group_id, members, dropped),
                                      [p for p in members if str(p) not in dropped],
                                      f"we do not leave out {sorted(dropped)}"))

    def _forget(self, group_id: bytes, why: AllReduceFailed) -> None:
        """Drop a group (its tensors with it); for `stall` s more, streams naming it get `why` at once."""
        gone = asyncio.get_running_loop().create_future()
        gone.set_exception(why)
        gone.exception()  # retrieved: nobody awaiting it is not an error
        self._groups[group_id] = gone
        asyncio.get_running_loop().call_later(self.stall, lambda: self._groups.get(group_id) is gone
                                              and self._groups.pop(group_id))

    async def _wait_group(self, group_id: object, channel: Channel) -> Optional[GroupState]:
        """The group a stream names; a member may push before we left matchmaking, so wait up to `stall`."""
        if not isinstance(group_id, bytes):
            await channel.refuse("malformed group id")
            return None
        slot = self._groups.get(group_id)
        if slot is None:
            if (sum(not f.done() for f in self._groups.values()) >= MAX_PENDING_GROUPS
                    or self._opened[channel.peer] >= MAX_PENDING_PER_PEER):
                await channel.refuse("too many unknown groups pending")
                return None
            slot = self._groups[group_id] = asyncio.get_running_loop().create_future()
        self._opened[channel.peer] += 1
        try:
            return await asyncio.wait_for(asyncio.shield(slot), self.stall)
        except TimeoutError:
            if self._groups.get(group_id) is slot and not slot.done():
                del self._groups[group_id]
            await channel.refuse(f"group {group_id.hex()[:8]} never started here")
        except AllReduceFailed as e:  # refuse, not fail: its HELLO and chunks still arriving must not reset the FAIL
            await channel.refuse(str(e), e.culprit)
        finally:
            self._opened[channel.peer] -= 1
            if not self._opened[channel.peer]:
                del self._opened[channel.peer]
        return None
