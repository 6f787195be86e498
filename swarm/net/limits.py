"""What one peer lets the network hold of it: incoming streams (per remote peer and in total) and the process's
file descriptors.

Every incoming stream is a file descriptor in this process (p2pd hands each one over its own unix socket)
and a task on the network loop. `Streams` caps how many are open at once over all the handlers of one P2P
instance (all-reduce, its repairs and audits, the state server): `MAX_STREAMS_PER_PEER` from one remote
peer and `MAX_STREAMS` in total; `wire.serve` refuses a stream over either cap before reading a byte of it,
unless one still waiting for its first frame gives way to it (`Streams`).
An honest peer holds a few at a time at one groupmate (its all-reduce stream, one lingering from the last
outer step, an audit fetch, a repair, a state download); a group of `swarm.target_group_size` 64 holds about
130 at each of its members. Memory per stream is bounded by the frame sizes its handler accepts
(wire.py), which arrive before they are buffered.

`raise_open_files()`: at a peer's start its soft RLIMIT_NOFILE is raised to the hard limit (logged): the
stream caps, the DHT's connections and the checkpoint files then fit with room to spare.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)

MAX_STREAMS = 512  # incoming streams open at once, all handlers of one peer together
MAX_STREAMS_PER_PEER = 16  # of those, from one remote peer


@dataclass(eq=False)
class Ticket:
    """One incoming stream counted by `Streams`; `evict` ends it (its handler sees the stream close)."""

    peer: str
    evict: Callable[[], None]
    waiting: bool = True  # its first frame is not whole yet
    open: bool = True


class Streams:
    """Counts of the incoming streams open now, by remote peer.

    Over a cap, a new stream takes the place of one still waiting for its first frame, if there is one: an honest
    peer sends its HELLO in the write that opens the stream, so a stream that holds a place without it is a
    trickle (wire.py ends it after FIRST_FRAME_STALLS x stall, as an offense). Over its peer's cap the peer's
    newest such stream gives way (the older ones run into their deadline and get the peer charged); over the
    total cap the oldest of anyone's. Without this, a trickler's own all-reduce streams were refused by its
    groupmates (its cap full of its trickles): its groups failed, and its honest code blamed the groupmates that
    refused it, which left an honest peer out of an outer step."""

    def __init__(self, total: int = MAX_STREAMS, per_peer: int = MAX_STREAMS_PER_PEER):
        self.total, self.per_peer = total, per_peer
        self.by_peer: Counter[str] = Counter()
        self.waiting: list[Ticket] = []  # in the order they came

    @property
    def open(self) -> int:
        return self.by_peer.total()

    def take(self, peer: object, evict: Callable[[], None] = lambda: None) -> Ticket | str:
        """Count one more stream from `peer` (making room as the class says); or, over a cap with no room to
        make, count nothing and say why it is refused."""
        key = str(peer)
        if self.by_peer[key] >= self.per_peer:
            room = [t for t in self.waiting if t.peer == key][-1:]
            refusal = f"{key} holds {self.by_peer[key]} streams here already, the most one peer may ({self.per_peer})"
        elif self.open >= self.total:
            room = self.waiting[:1]
            refusal = f"this peer holds {self.open} incoming streams already, the most it takes ({self.total})"
        else:
            room, refusal = [], None
        if refusal is not None and not room:
            return refusal
        for ticket in room:
            self.release(ticket)
            ticket.evict()
        ticket = Ticket(key, evict)
        self.by_peer[key] += 1
        self.waiting.append(ticket)
        return ticket

    def arrived(self, ticket: Ticket) -> None:
        """The stream's first frame is whole: it no longer gives way to others."""
        if ticket.waiting:
            ticket.waiting = False
            self.waiting.remove(ticket)

    def release(self, ticket: Ticket) -> None:
        """The stream ended (once per ticket; later calls do nothing)."""
        if not ticket.open:
            return
        self.arrived(ticket)
        ticket.open = False
        self.by_peer[ticket.peer] -= 1
        if self.by_peer[ticket.peer] <= 0:
            del self.by_peer[ticket.peer]


_BY_P2P: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def streams_of(p2p: object) -> Streams:
    """The stream counts of one P2P instance, shared by every handler `wire.serve` registers on it."""
    found = _BY_P2P.get(p2p)
    if found is None:
        found = _BY_P2P[p2p] = Streams()
    return found


def raise_open_files() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit; returns (before, after), logged."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 2**20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning(f"could not raise the open-file limit from {soft} to {target}: {e}")
            return soft, soft
        logger.info(f"raised the open-file limit (RLIMIT_NOFILE) from {soft} to {target}")
        return soft, target
    logger.info(f"open-file limit (RLIMIT_NOFILE): {soft}, already the hard limit")
    return soft, soft
