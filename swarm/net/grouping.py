"""Who this peer averages with, among the members matchmaking put in its group.

- `on_majority_base`: only members on the group's majority global parameters (the others take its state).
- `clients`, `dialable`: the members that cannot be dialed (`swarm.client_mode`) own no part, and are never
  dialed (not even to say that we leave a group).
- `agreed_chunk`: the chunk size all members cut parts with, whatever their own time-outs.
- `Offenses`: groupmates that made an attempt fail (`AllReduceFailed.culprit`). One is left out of this
  peer's later groups in the same outer step (proven) or averaging attempt (unproven); one caught sending what no
  honest peer sends (`blame` PROOF: malformed or non-finite data, a weight other than announced, a wrong
  average found by an audit) commits an offense, and one caught `access.BAN_AFTER` times is banned for the
  run (access.py keeps the counts, the bans and the events; a groupmate's word, TOLD, never bans: a liar
  could name anyone), and so is every peer `Access` refuses (a stranger to a private swarm's allowlist).
  Matchmaking cannot refuse a peer (hivemind forms the group), so `exclude` drops the offenders from a
  formed group and gives the rest a new group id (`without`: the old id plus who was dropped), and tells the
  groupmates it leaves the old group, naming whom it drops. Groupmates that caught the same offender (each
  owner sees a bad contributor itself) run the new group together at once.
- `adopted`: a groupmate that did not catch the offender itself (only told of it by the owner that did, which it
  cannot check) runs the new group too when more than half of the groupmates outside the dropped set left the
  old group naming that set: so k peers acting together, k below half of the group, cannot drop an honest peer
  from a group of others. Otherwise it declines the new group at once (its members retry, instead of waiting
  out `stall_timeout` for it). Without this, the groupmates that had proof ran the new group, the one that was
  only told ran the old one, and each side waited for the other until it stalled, then blamed it: an honest
  peer left out and behind by the end of the outer step (the hostile table's 3-of-4-rounds rows).
"""

from __future__ import annotations

import logging
from typing import Optional

from hivemind.p2p import PeerID

from swarm.net.access import Access
from swarm.net.allreduce import AllReduceFailed
from swarm.net.allreduce.groupstate import subgroup_id
from swarm.net.budget import CHUNK_ELEMENTS
from swarm.net.matchmaking import Group, NoGroup

logger = logging.getLogger(__name__)

class OtherBase(Exception):
    """The group's majority holds other global parameters than ours; `donors` are its members."""

    def __init__(self, reason: str, donors: list[str]):
        super().__init__(reason)
        self.donors = donors


def on_majority_base(group: Group, base: str) -> Group:
    """Keep the members whose global parameters (`base` hash) are the group's majority; ties go to the
    larger hash, so every member picks the same subgroup. A member outside it raises OtherBase."""
    bases = [m.get("base") for m in group.metas]
    majority = max(set(bases), key=lambda b: (bases.count(b), str(b)))
    keep = [i for i, b in enumerate(bases) if b == majority]
    if base != majority:
        raise OtherBase(f"global parameters differ from {len(keep)} of {len(bases)} groupmates: "
                        f"taking their state", [str(group.members[i]) for i in keep])
    if len(keep) < len(bases):
        logger.warning(f"{len(bases) - len(keep)} groupmates hold other global parameters; averaging without them")
    if len(keep) == 1:
        raise NoGroup("no groupmate shares our global parameters", alone=True)
    return Group(group.group_id, [group.members[i] for i in keep], [group.metas[i] for i in keep])


def clients(group: Group) -> list[int]:
    """The members that announced `client` (`swarm.client_mode`: they cannot be dialed): they own no part of
    the vector and nobody opens a stream to them. AllReduceFailed if all are clients: nobody could own a part."""
    out = [i for i, m in enumerate(group.metas) if isinstance(m, dict) and m.get("client") is True]
    if len(out) == len(group.members):
        raise AllReduceFailed(f"all {len(out)} members of the group are clients (swarm.client_mode): "
                              f"nobody can own a part")
    return out


def dialable(group: Group) -> list[PeerID]:
    """The members we may open a stream to: not the clients."""
    return [p for p, m in zip(group.members, group.metas) if not (isinstance(m, dict) and m.get("client") is True)]


def agreed_chunk(group: Group) -> int:
    """The smallest chunk any member asked for in matchmaking (each its `budget.chunk_elements`, from its own
    stall_timeout and min_bandwidth): members whose time-outs differ still cut the parts alike, instead of
    refusing each other's chunks as malformed (and naming an honest peer the culprit)."""
    for peer, meta in zip(group.members, group.metas):
        c = meta.get("chunk")
        if not (type(c) is int and 2**10 <= c <= CHUNK_ELEMENTS and c & (c - 1) == 0):
            raise AllReduceFailed(f"{peer} asked for chunks of {c!r} elements, not a power of two in "
                                  f"[2^10, {CHUNK_ELEMENTS}]", peer)
    return min(meta["chunk"] for meta in group.metas)


class Offenses:
    """Who sits out this peer's groups. A proven offender (we saw it send what no honest peer sends) sits out
    the rest of the outer step, and `access` counts the offense. An unproven culprit (SEEN: it went silent, as an
    honest peer on a bad link does; TOLD: a groupmate's word, which a liar gives against anyone) sits out the
    rest of this averaging attempt only (`begin` takes it back), and not even that when it is the only one left
    to average with (`exclude`). Left out for the outer step, honest peers that blamed each other for a trickler's
    stalls stayed apart, and since a discarded outer step is retried at the same outer step the leave-outs never lapsed
    ("only offenders in our group; retrying" for ever); left out for the attempt, they lost the outer step."""

    def __init__(self, access: Access):
        self.access = access
        self.outer_step, self.proven, self.unproven = -1, set(), set()

    def _at(self, outer_step: int) -> None:
        if outer_step != self.outer_step:
            self.outer_step, self.proven, self.unproven = outer_step, set(), set()

    def begin(self, outer_step: int) -> None:
        """A new averaging attempt of `outer_step` (the first, or a retry after a discard): unproven leave-outs
        lapse."""
        self._at(outer_step)
        self.unproven = set()

    def record(self, peer: PeerID | str, outer_step: int, reason: str, proven: bool = True,
               conclusive: bool = False) -> None:
        """`peer` made an attempt of `outer_step` fail: out of our groups (see the class); `proven` also counts an
        offense (`conclusive`: one that bans at once). Unproven: only noted."""
        self._at(outer_step)
        (self.proven if proven else self.unproven).add(str(peer))
        if proven:
            self.access.offense(peer, reason, conclusive)
        else:
            self.access.note("left out", peer, f"outer step {outer_step + 1}: {reason}")

    def excluded(self, peer: PeerID, outer_step: int) -> bool:
        return not self.access.seats(peer) or (outer_step == self.outer_step
                                               and str(peer) in self.proven | self.unproven)

    def exclude(self, group: Group, outer_step: int) -> tuple[Group, frozenset[str]]:
        """`group` without the offenders (under a new id if any was dropped) and the ids of those dropped; NoGroup
        if only we remain."""
        out = [i for i, p in enumerate(group.members) if self.excluded(p, outer_step)]
        keep = [i for i in range(len(group.members)) if i not in out]
        back = [i for i in out if self.access.seats(group.members[i]) and str(group.members[i]) not in self.proven]
        if len(keep) < 2 and back:  # nobody else is here: an unproven culprit may only have been framed
            logger.info(f"outer step {outer_step + 1}: taking back {[str(group.members[i]) for i in back]}: left "
                        f"out on unproven grounds, and nobody else is in our group")
            self.unproven -= {str(group.members[i]) for i in back}
            out = [i for i in out if i not in back]
            keep = sorted([*keep, *back])
        if not out:
            return group, frozenset()
        dropped = [str(group.members[i]) for i in out]
        logger.warning(f"outer step {outer_step + 1}: leaving out offenders {dropped}")
        if len(keep) < 2:
            raise NoGroup(f"only offenders {dropped} in our group", alone=False, left=group)
        return without(group, frozenset(dropped)), frozenset(dropped)


def without(group: Group, dropped: frozenset[str]) -> Group:
    """`group` less the members in `dropped` (peer ids), under the id every member that drops them computes: the
    old id, then the dropped members' ids in group order."""
    keep = [i for i, p in enumerate(group.members) if str(p) not in dropped]
    return Group(subgroup_id(group.group_id, group.members, dropped), [group.members[i] for i in keep],
                 [group.metas[i] for i in keep])


def adopted(group: Group, me: str, left_outs: dict[str, frozenset[str]]) -> Optional[frozenset[str]]:
    """The set of members to drop from `group` that we adopt from the groupmates that left it (`left_outs`: member
    -> the members it named as left out), or None. A set is adopted when more than half of the members outside it,
    us apart, named exactly it; never a set holding us (module docstring)."""
    members = {str(p) for p in group.members}
    for dropped in sorted(set(left_outs.values()), key=sorted):
        if not dropped or me in dropped or not dropped < members:
            continue
        electorate = members - dropped - {me}
        supporters = {p for p, named in left_outs.items() if named == dropped and p in electorate}
        if 2 * len(supporters) > len(electorate):
            return dropped
    return None
