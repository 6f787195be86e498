"""Who may take part in this peer's outer steps: the run's allowlist, minus peers banned for misbehaving.

One `Access` per peer is asked by every gate: matchmaking (a group holding a refused member is left, and a
leader refuses its join request), the all-reduce's stream handlers and the state server (a refused peer's
streams are failed at once). Peers are base58 peer ids, which libp2p authenticates on every stream.

A peer that sends what no honest peer sends (malformed matchmaking metadata, a part that does not decode,
a wrong average for its part) commits an offense; after `BAN_AFTER` offenses it is banned for the rest
of the run. Offenses are counted per peer id in a bounded table, so a flood of identities cannot grow it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Optional

logger = logging.getLogger(__name__)

BAN_AFTER = 2  # one offense may be a bug or a bad link (a truncated stream); two in one run are a pattern
MAX_TRACKED = 4096  # offenders remembered at once; the oldest non-banned entries are forgotten first
MAX_EVENTS = 256  # events kept for this peer's summary (offenses, bans, ignored claims); later ones are counted


class Access:
    def __init__(self, allowed: Optional[frozenset[str]] = None, ban_after: int = BAN_AFTER):
        self.allowed, self.ban_after = allowed, ban_after
        self.banned: set[str] = set()
        self._offenses: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()  # the trainer's thread and the network thread both report offenses
        self.events: list[dict] = []  # for the peer's summary: who was refused, and for what
        self.dropped_events = 0
        self._noted: set[tuple[str, str]] = set()
        self.proven: Optional[frozenset[str]] = None  # swarm.identity_work: peers with proven ids (None: off)

    @property
    def tracked(self) -> int:
        """How many peers' offenses are counted now (at most MAX_TRACKED: the oldest are forgotten)."""
        return len(self._offenses)

    def note(self, event: str, peer_id: object, what: str) -> None:
        """Record an event about a peer for the summary; each (event, peer) once, at most MAX_EVENTS."""
        key = (event, str(peer_id))
        with self._lock:
            if key in self._noted:
                return
            if len(self.events) >= MAX_EVENTS:
                self.dropped_events += 1
                return
            self._noted.add(key)
            self.events.append({"event": event, "time": time.time(), "peer_id": str(peer_id), "what": what})

    def prove(self, peers: set[str]) -> None:
        """The peers whose proof of work the last read of the records showed (swarm.identity_work)."""
        self.proven = frozenset(peers)

    def seats(self, peer_id: object) -> bool:
        """Whether `peer_id` may hold a seat in our groups: admitted, and with swarm.identity_work proven."""
        if not self.admits(peer_id):
            return False
        if self.proven is not None and str(peer_id) not in self.proven:
            self.note("unproven", peer_id, "its peer id shows no proof of work (swarm.identity_work)")
            return False
        return True

    def admits(self, peer_id: object) -> bool:
        peer = str(peer_id)
        return peer not in self.banned and (self.allowed is None or peer in self.allowed)

    def refusal(self, peer_id: object) -> str:
        """Why `peer_id` is refused (for the FAIL frame and the log)."""
        peer = str(peer_id)
        if peer in self.banned:
            return f"{peer} is banned from this run"
        return f"{peer} is not in this run's allowlist (swarm.allowed_peers)"

    def offense(self, peer_id: object, what: str, conclusive: bool = False) -> bool:
        """Count one offense of `peer_id`; True if it is now banned. `conclusive`: what no honest peer ever does
        (allreduce.CONCLUSIVE), banned at once."""
        peer = str(peer_id)
        with self._lock:
            count = self._offenses.pop(peer, 0) + 1
            self._offenses[peer] = count
            while len(self._offenses) > MAX_TRACKED:
                self._offenses.popitem(last=False)
            banned = (conclusive or count >= self.ban_after) and peer not in self.banned
            if banned:
                self.banned.add(peer)
        self.note("offense", peer, what)
        if not banned:
            logger.warning(f"offense by {peer}: {what}")
            return False
        why = f"at once, conclusive: {what}" if conclusive else f"after {count} offenses; the last: {what}"
        self.note("banned", peer, why)
        logger.warning(f"banned {peer} for the rest of the run {why}")
        return True
