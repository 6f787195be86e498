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

Claims are believed only within bounds (`plausible`), since any stranger may sign records: a round more
than one past the lower median of the other live peers' rounds (with no other peer live, of the others'
last commits) is ignored, so a forger claiming round 2**40 is neither followed nor taken as a donor; and
others are `ready` (this peer stops its inner steps early to meet them) only when most live peers that may
average this round say so, so one peer claiming readiness from the start of every round cannot cut
everyone's rounds short.
Both hold while honest peers are the majority of the peers one reads; a private swarm
(`swarm.auth: allowlist`) keeps strangers out altogether.
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
    others_ready: bool = False  # most live peers that may average our round finished their inner steps
    note: str = ""
    ignored: tuple[str, ...] = ()  # peers whose round claims were implausible (see `plausible`)


def is_live(record: ProgressRecord, now: float, window: float) -> bool:
    return now - record.time <= window


def _lower_median(values: list[int]) -> int:
    return sorted(values)[(len(values) - 1) // 2]


def plausible(me: str, progress: Sequence[ProgressRecord], commits: Mapping[str, CommitRecord], now: float,
              window: float) -> tuple[list[ProgressRecord], dict[str, CommitRecord]]:
    """The records whose round is at most one past the others' majority (ours are always kept). One round
    per other peer: its live progress record's, else its last commit's. With other peers live, the ceiling
    is one past the lower median of those rounds, or of the live ones alone if that is higher (peers that
    left long ago do not hold back the live swarm). With nobody else live, one past the upper median of the
    last commits: a peer restarted after the swarm finished (its own former id among the commits, one round
    in) still learns how far the swarm got, and one forged commit among honest ones is still outvoted."""
    live = {r.peer_id: r.round for r in progress if is_live(r, now, window) and r.peer_id != me}
    rounds = [*live.values(), *(c.round for p, c in commits.items() if p != me and p not in live)]
    if not rounds:
        return list(progress), dict(commits)
    if live:
        ceiling = max(_lower_median(rounds), _lower_median(list(live.values()))) + 1
    else:
        ceiling = sorted(rounds)[len(rounds) // 2] + 1
    return ([r for r in progress if r.peer_id == me or r.round <= ceiling],
            {p: c for p, c in commits.items() if p == me or c.round <= ceiling})


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
    claimed = {r.peer_id for r in progress} | set(commits)
    live_ids = {r.peer_id for r in progress if is_live(r, now, window)}
    progress, commits = plausible(me, progress, commits, now, window)
    ignored = tuple(sorted(claimed - {r.peer_id for r in progress} - set(commits)))
    unsure = len(live_ids - {r.peer_id for r in progress})  # live, at a round it does not tell: may join us
    live = [r for r in progress if is_live(r, now, window)]
    tally = votes(progress, commits, now, window)
    swarm_round = max([round, *tally])
    swarm_sha = winner(tally.get(swarm_round, Counter()))
    if not any(r.peer_id == me for r in live):
        return Position(Verdict.UNSURE, swarm_round, swarm_sha, None, note="progress records unreadable",
                        ignored=ignored)
    others = [r for r in live if r.peer_id != me]
    if swarm_round > round:
        ahead = [r for r in others if r.round > round and r.serves_state
                 and r.sha256 == winner(tally.get(r.round, Counter()))]
        ahead.sort(key=lambda r: (-r.round, r.peer_id))
        return Position(Verdict.BEHIND, swarm_round, swarm_sha, None, tuple(r.peer_id for r in ahead),
                        note=f"behind: the swarm committed round {swarm_round}, we hold round {round}",
                        ignored=ignored)
    expected = sum(1 for r in live if r.round in (round - 1, round)) + unsure
    here = Counter(r.sha256 for r in others if r.round == round and r.sha256) + Counter({sha256: 1})
    majority = winner(here)
    if majority != sha256:
        donors = tuple(sorted(r.peer_id for r in others if r.round == round and r.sha256 == majority
                              and r.serves_state))
        return Position(Verdict.DIVERGED, swarm_round, swarm_sha, expected, donors,
                        note=f"{here[majority]} of {here.total()} live peers at round {round} hold other "
                             f"global parameters than ours", ignored=ignored)
    mates = [r for r in others if r.round == round and r.sha256 in (sha256, "")]
    # most of the others that may average this round (those still showing the round before count as not
    # ready: right after a commit, a forger claiming readiness may be the only one showing the new round)
    ready = 2 * sum(r.ready for r in mates) > expected - 1
    if not mates:
        return Position(Verdict.ALONE, swarm_round, swarm_sha, expected, note="alone", ignored=ignored)
    return Position(Verdict.AVERAGE, swarm_round, swarm_sha, expected, others_ready=ready,
                    note=f"{len(mates)} live peers share round {round}", ignored=ignored)
