"""One all-reduce as one member sees it (`GroupState`), and what the member puts in (`Contribution`).

The state is touched only by coroutines on the network thread; `changed` wakes every waiter whenever a
chunk arrives, a part advances or the group fails, and each waiter re-checks its own condition.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from hivemind.p2p import PeerID

from swarm.errors import SwarmError
from swarm.net.allreduce import hashing
from swarm.net.allreduce.layout import WireLayout
from swarm.net.allreduce.robust import Rule, cap_weights
from swarm.net.wire import Traffic
from swarm.tensors import Buffers

WINDOW = 2
"""Chunks an owner reads ahead of the slowest member's results: its memory for contributions is at most
WINDOW x members chunks, however fast a member pushes."""


PROOF, SEEN, TOLD, CONCLUSIVE = "proof", "seen", "told", "conclusive"
"""How we know who made an all-reduce fail (`AllReduceFailed.blame`):
- CONCLUSIVE: we saw it send non-finite values, which no honest peer sends whatever its codec or link (it checks
  its own values, codecs clamp, streams are authenticated and encrypted): banned at once;
- PROOF: we saw it ourselves send what no honest peer sends (malformed data, a weight other than
  it announced, a wrong average, two signed digests of one part): an offense (access.py: banned after
  BAN_AFTER);
- SEEN: we saw it go silent, or leave, in the middle of its part (an honest peer may die or lose its link);
- TOLD: a groupmate's FAIL named it (the groupmate saw it, or was told), which a liar could do to anyone.
SEEN and TOLD only keep it out of our groups for the rest of the averaging attempt (grouping.Offenses), never an
offense.
Every FAIL we send names our failure's culprit, whatever we know it by, so that every member of a group that
fails because of one peer names that peer, whichever message reaches it first."""


class AllReduceFailed(SwarmError):
    """One all-reduce did not produce a complete result; the message says which part and why. `culprit`: the
    groupmate held responsible, and `blame` how we know it (PROOF, TOLD); the caller keeps it out of later
    groups."""

    def __init__(self, reason: str, culprit: Optional[PeerID] = None, blame: str = PROOF):
        super().__init__(reason)
        self.culprit, self.blame = culprit, blame


def subgroup_id(group_id: bytes, members: Sequence[PeerID], dropped: frozenset[str]) -> bytes:
    """The id of group `group_id` less the members in `dropped` (peer ids), as every member that drops them
    computes it: the old id, then the dropped members' ids in group order."""
    h = hashlib.sha256(group_id)
    for peer in members:
        if str(peer) in dropped:
            h.update(peer.to_bytes())
    return h.digest()[:16]


def check_weights(members: Sequence[PeerID], weights: Sequence[object], me: int, ours: float) -> None:
    """The weights all members agreed on (matchmaking) must be finite numbers >= 0, ours among them, one > 0;
    AllReduceFailed naming the member whose is not."""
    for i, w in enumerate(weights):
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0):
            raise AllReduceFailed(f"{'our own' if i == me else members[i]} weight {w!r} is not a finite "
                                  f"number >= 0", None if i == me else members[i])
    if weights[me] != ours or not any(w > 0 for w in weights):
        raise AllReduceFailed(f"weights {list(weights)}: ours is not {ours} or none is > 0")


@dataclass
class Contribution:
    """What one member puts into an all-reduce, and where the average goes."""

    read: Callable[[int, int, int], torch.Tensor]  # (tensor, start, end) -> fp32 CPU elements of its vector
    weight: float
    out: Sequence[torch.Tensor] | Buffers  # the weighted mean is written here, in place, chunk by chunk
    residual: Optional[Sequence[torch.Tensor]] = None  # zeroed; gets what quantization dropped from `read`

    def __post_init__(self) -> None:
        self.out = Buffers.of(self.out)


class GroupState:
    """This member's view of one all-reduce."""

    def __init__(self, group_id: bytes, members: Sequence[PeerID], me: int, layout: WireLayout,
                 contribution: Contribution, weights: Sequence[float], rule: Rule,
                 keys: Optional[Sequence[bytes]] = None):
        n = len(members)
        self.group_id, self.members, self.me, self.layout, self.mine = group_id, list(members), me, layout, contribution
        self.chunks = [layout.chunks(j) for j in range(n)]
        self.traffic = Traffic()
        self.changed = asyncio.Condition()
        self.failure: Optional[str] = None
        self.culprit: Optional[PeerID] = None
        self.blame = PROOF
        self.rule = rule
        # the weights every member agreed on (matchmaking), and the shares every owner reduces with
        self.weights = [float(w) for w in weights]
        self.shares = cap_weights(self.weights, rule.max_weight_share)
        self.hello = {me}  # members whose stream to us (the owner) said HELLO
        # owner side: contributions to our part, and its encoded averages until every member was sent them
        self.digests: dict[int, list[Optional[bytes]]] = {}  # verify_parts: what each member sent, hashed
        self.pending: dict[int, list[Optional[torch.Tensor]]] = {}
        self.results: dict[int, bytes] = {}
        self.delivered = [0] * n  # result chunks sent to each member; math.inf once it needs no more
        self.delivered[me] = math.inf
        self.settled = {me}  # members that need nothing more from us (DONE, or gone)
        # member side: chunks of every part written into `out`
        self.have = [0] * n
        if me in layout.clients:  # nobody can dial a client, so nobody pushes to it: nobody waits on it either
            self.hello, self.settled, self.delivered = set(range(n)), set(range(n)), [math.inf] * n
        self.channels: dict[int, object] = {}  # our stream to each part's owner (wire.Channel)
        self.audit_pick: dict[int, int] = {}  # verify_parts: the chunk of each part we recompute (audit.py)
        self.audit_got: dict[int, tuple[bytes, bytes]] = {}  # (owner's digests, its result) of that chunk
        self.audited = not rule.verify
        # groupmates' failed audits (reason, the culprit they name), acted on once ours is done (audit.py)
        self.refusals: list[tuple[str, Optional[PeerID]]] = []
        self.audits_served: set[tuple[PeerID, int]] = set()  # (groupmate, part) whose contribution we re-sent
        # a client's contributions for our audits come on a stream it opens (audit.offer): by client index
        self.offers: dict[int, asyncio.Future] = {}
        # who lied when an audit disagrees (evidence.py): as an owner, the digests of what each member pushed us,
        # and its signature over them once its DIGEST came
        self.received: dict[int, list[bytes]] = {}
        self.evidence: dict[int, tuple[bytes, bytes]] = {}
        self.evidence_served: set[tuple[PeerID, int]] = set()  # (auditor, member) whose evidence we sent
        self.ends_at: Optional[float] = None  # loop time of the run's deadline (None: not started)
        # one result per part (agree.py), with every member's public key: off without them
        self.keys = list(keys) if keys is not None else None
        self.agreeing = keys is not None
        self.hashes = {j: hashing.Running() for j in range(n)}  # of the results we take, by part
        self.signed: dict[int, tuple[bytes, bytes]] = {}  # part -> (its digest, its owner's signature)
        self.signatures: dict[bytes, bytes] = {}  # our signature of each digest of our part we sent
        self.vectors: dict[int, dict[int, bytes]] = {}  # member -> the digests its DONE carried, by part
        self.gone: set[int] = set()  # members whose stream to us ended without a DONE
        self.agreed: set[int] = set()  # owners that answered our DONE with theirs (or left)
        self.repaired: set[int] = set()  # parts taken from a groupmate (repair.py): no owner's digest
        self.lost: set[int] = set()  # parts whose owner we lost before we held their whole average (repair.py)

    def complete(self) -> bool:
        return all(h == len(c) for h, c in zip(self.have, self.chunks))

    def read_out(self, tensor: int, start: int, end: int) -> torch.Tensor:
        """Elements of the average this member holds (for a groupmate's repair)."""
        return self.mine.out.read(tensor, start, end)

    def window_end(self) -> float:
        return min(self.delivered) + WINDOW

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], stall: Optional[float], what: str) -> None:
        """Wait until `predicate()` or a failure; AllReduceFailed naming `what` after `stall` s (None: never)
        without it."""
        try:
            async with asyncio.timeout(stall):
                async with self.changed:
                    await self.changed.wait_for(lambda: predicate() or self.failure is not None)
        except TimeoutError:
            raise AllReduceFailed(f"{what}: nothing arrived for {stall:g} s (swarm.stall_timeout)") from None
        if self.failure is not None and not predicate():
            raise AllReduceFailed(self.failure, self.culprit, self.blame)

    async def fail(self, reason: str, culprit: Optional[PeerID] = None, blame: str = PROOF) -> None:
        if self.failure is None:
            self.failure, self.culprit, self.blame = reason, culprit, blame
        await self.notify()

    def failed(self) -> AllReduceFailed:
        return AllReduceFailed(self.failure or "failed", self.culprit, self.blame)
