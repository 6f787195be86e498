"""What one peer lets the network hold of it: incoming streams (per remote peer and in total) and the process's
file descriptors.

Every incoming stream is a file descriptor in this process (p2pd hands each one over its own unix socket)
and a task on the network loop. `Streams` caps how many are open at once over all the handlers of one P2P
instance (all-reduce, its repairs and audits, the state server): `MAX_STREAMS_PER_PEER` from one remote
peer and `MAX_STREAMS` in total; `wire.serve` refuses a stream over either cap before reading a byte of it.
An honest peer holds a few at a time at one groupmate (its all-reduce stream, one lingering from the last
round, an audit fetch, a repair, a state download); a group of `swarm.target_group_size` 64 holds about
130 at each of its members. Memory per stream is bounded by the frame sizes its handler accepts
(wire.py), which arrive before they are buffered.

`raise_open_files()`: at a peer's start its soft RLIMIT_NOFILE is raised to the hard limit (logged): the
stream caps, the DHT's connections and the checkpoint files then fit with room to spare.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from typing import Optional

logger = logging.getLogger(__name__)

MAX_STREAMS = 512  # incoming streams open at once, all handlers of one peer together
MAX_STREAMS_PER_PEER = 16  # of those, from one remote peer


class Streams:
    """Counts of the incoming streams open now, by remote peer."""

    def __init__(self, total: int = MAX_STREAMS, per_peer: int = MAX_STREAMS_PER_PEER):
        self.total, self.per_peer = total, per_peer
        self.by_peer: Counter[str] = Counter()

    @property
    def open(self) -> int:
        return self.by_peer.total()

    def take(self, peer: object) -> Optional[str]:
        """Count one more stream from `peer`; or, over a cap, count nothing and say why it is refused."""
        key = str(peer)
        if self.by_peer[key] >= self.per_peer:
            return f"{key} holds {self.by_peer[key]} streams here already, the most one peer may ({self.per_peer})"
        if self.open >= self.total:
            return f"this peer holds {self.open} incoming streams already, the most it takes ({self.total})"
        self.by_peer[key] += 1
        return None

    def release(self, peer: object) -> None:
        key = str(peer)
        self.by_peer[key] -= 1
        if self.by_peer[key] <= 0:
            del self.by_peer[key]


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
