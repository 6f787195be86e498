"""Who is alive, ahead, behind or in the majority: one pure function over the records a peer read.

`assess` takes this peer's round and hash and the DHT records it just read (progress records of peers,
commit records of every peer that ever committed) and returns one `Position`. The averager acts on it; the
function itself does no I/O, so it is tested over tables of records (tests/net/test_policy.py).

- Live: a peer whose progress record was re-stored within `window` s (`config.live_window`). Its heartbeat
  re-stores it every `progress_interval` whatever the trainer does, so a record that stopped changing is a
  dead peer's, long before it expires from the DHT.
- The hash of a round: one vote per peer, from its live progress record, else from its last commit record;
  the most votes win, ties go to the larger hash (so every peer picks the same side).
- BEHIND: some peer committed a later round than ours (live or not: a peer that comes back after the
  others finished must not train on alone from an older round). Donors: live peers past our round that
  serve their state and hold their round's winning hash, freshest first.
- DIVERGED: most live peers at our round hold another hash than ours. Donors: those that serve it.
- ALONE: nobody else live at our round with our hash, nobody ahead: apply our own pseudo-gradient.
- AVERAGE: peers share our round and hash: keep matchmaking with them.
- UNSURE: the read misses our own fresh record, so it failed (a DHT time-out looks like an empty swarm):
  decide nothing on it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Optional, Sequence

from swarm.net.schema import CommitRecord, ProgressRecord


class Verdict(Enum):
    AVERAGE = "average"
    ALONE = "alone"
    BEHIND = "behind"
    DIVERGED = "diverged"
    UNSURE = "unsure"


@dataclass(frozen=True)
class Position:
    verdict: Verdict
    swarm_round: int  # the highest round any peer committed, live or gone (ours at least)
    swarm_sha256: Optional[str]  # that round's winning hash
    expected_group: Optional[int]  # live peers that may average our round, us included (None: unsure)
    donors: tuple[str, ...] = ()  # BEHIND / DIVERGED: peer ids to take the state from, best first
    others_ready: bool = False  # a live peer at our round and hash finished its inner steps
    note: str = ""


def is_live(record: ProgressRecord, now: float, window: float) -> bool:
    return now - record.time <= window


def votes(progress: Sequence[ProgressRecord], commits: Mapping[str, CommitRecord], now: float,
          window: float) -> dict[int, Counter]:
    """Per round, how many peers vouch for each hash: live peers by their progress record, others by their
    last commit record."""
    live = {r.peer_id: r for r in progress if is_live(r, now, window)}
    tally: dict[int, Counter] = defaultdict(Counter)
    for record in [*live.values(), *(c for p, c in commits.items() if p not in live)]:
        if record.sha256:
            tally[record.round][record.sha256] += 1
    return tally


def winner(counts: Counter) -> Optional[str]:
    """The hash with the most votes; ties go to the larger hash."""
    return max(counts, key=lambda h: (counts[h], h)) if counts else None


def assess(me: str, round: int, sha256: str, progress: Sequence[ProgressRecord],
           commits: Mapping[str, CommitRecord], now: float, window: float) -> Position:
    live = [r for r in progress if is_live(r, now, window)]
    tally = votes(progress, commits, now, window)
    swarm_round = max([round, *tally])
    swarm_sha = winner(tally.get(swarm_round, Counter()))
    if not any(r.peer_id == me for r in live):
        return Position(Verdict.UNSURE, swarm_round, swarm_sha, None, note="progress records unreadable")
    others = [r for r in live if r.peer_id != me]
    if swarm_round > round:
        ahead = [r for r in others if r.round > round and r.serves_state
                 and r.sha256 == winner(tally.get(r.round, Counter()))]
        ahead.sort(key=lambda r: (-r.round, r.peer_id))
        return Position(Verdict.BEHIND, swarm_round, swarm_sha, None, tuple(r.peer_id for r in ahead),
                        note=f"behind: the swarm committed round {swarm_round}, we hold round {round}")
    expected = sum(1 for r in live if r.round in (round - 1, round))
    here = Counter(r.sha256 for r in others if r.round == round and r.sha256) + Counter({sha256: 1})
    majority = winner(here)
    if majority != sha256:
        donors = tuple(sorted(r.peer_id for r in others if r.round == round and r.sha256 == majority
                              and r.serves_state))
        return Position(Verdict.DIVERGED, swarm_round, swarm_sha, expected, donors,
                        note=f"{here[majority]} of {here.total()} live peers at round {round} hold other "
                             f"global parameters than ours")
    mates = [r for r in others if r.round == round and r.sha256 in (sha256, "")]
    ready = any(r.ready for r in mates)
    if not mates:
        return Position(Verdict.ALONE, swarm_round, swarm_sha, expected, note="alone")
    return Position(Verdict.AVERAGE, swarm_round, swarm_sha, expected, others_ready=ready,
                    note=f"{len(mates)} live peers share round {round}")
