"""Who is alive, ahead, behind or in the majority: one pure function over the records a peer read.

`assess` takes this peer's outer step and hash and the DHT records it just read (progress records of peers,
commit records of every peer that ever committed) and returns one `Position`. The averager acts on it; the
function itself does no I/O, so it is tested over tables of records (tests/net/test_policy.py).

- Live: a peer whose progress record was re-stored within `window` s (`config.live_window`). Its heartbeat
  re-stores it every `progress_interval` whatever the trainer does, so a record that stopped changing is a
  dead peer's, long before it expires from the DHT.
- The quorum rule (`certified`): a hash at outer step s counts as committed by the swarm only if the live peers at
  s that hold it and serve it are at least half of the electorate of outer step s — the live peers that serve
  their state, and those that do not but stand at outer step s-1 or later (ties between two halves go to the
  larger hash, so every peer picks the same side) — and s is at most one past the lower median of the outer steps
  of the other live peers that serve their state (`ceiling`). So k peers acting together, k below half of
  the live peers, can neither make honest peers take their state (their claim of the next outer step, or of
  another hash at ours, never reaches half; a claim further ahead lies above the ceiling), nor make them skip
  an outer step, nor stop them (a forged commit record counts for nothing while others are live). Peers taking a
  state serve none meanwhile, and sit outer steps below: a burst of newcomers neither lowers the ceiling nor counts
  against the peers they catch up with. With no other peer live (every other peer left), the last commit
  records decide instead, the most votes winning: a peer that comes back after the others finished must not
  train on alone from an older outer step.
- Backed votes (`anchor`, certificates.py): among live peers, a record counts, as a vote and in the electorate,
  only where a certificate backs it: the group that committed its outer step and hash signed statements of it, and
  its key signed that certificate or others grounded on this peer's lineage in the window before. Free
  identities claiming an outer step ahead, however many, weigh nothing; two groups that split from one parent (or
  from the initial state, by its founders) count each other, and the tie-break settles them.
- Alone, by the keys it knows (`known`, ledger.py): with nobody else live, a peer that has taken part in the
  run counts the last commits of the keys it knows took part with it in its recent outer steps (a group it averaged
  with, the holders of a state it took), one vote each, and certifies a hash only when at least half of those
  keys signed it: one former groupmate of three, a lone survivor or a forger, is not, and a fresh key is nobody.
  A peer with nothing recorded (a newcomer; everyone at a run's first outer step) counts identities there.
- One hash, one outer step (`truthful`): a state's hash binds its count of outer steps, so a record of another peer that
  puts a hash we hold at another outer step is false and counts for nothing.
- BEHIND: the swarm committed a later outer step than ours. Donors: live peers at that outer step on its hash that serve
  it. DIVERGED: the swarm committed another hash at our outer step. Donors: those that serve it.
- ALONE: nobody else live at our outer step with our hash, nobody ahead: apply our own pseudo-gradient.
- AVERAGE: peers share our outer step and hash: keep matchmaking with them.
- UNSURE: the read misses our own fresh record, so it failed (a DHT time-out looks like an empty swarm):
  decide nothing on it.

- Plurality at our own outer step (`PLURALITY`): groups smaller than half the live peers (`swarm.target_group_size`
  below half the swarm, a churn that splits groups) may end an outer step on several hashes none of which half of
  them hold. At the outer step we stand at, the hash most backed peers hold then wins (at least two of them; ties to
  the larger hash), so the smaller lineages take it and the swarm is one again; a free identity's vote is not
  backed, so it cannot tip this either. Outer steps ahead of ours still need half: the first small group to commit
  must not pull everyone still averaging.

What the rule does not promise: lineages that split and then move at different paces (one an outer step ahead of the
other) each see the other only an outer step away, where half is needed; they stay apart until they meet at one
outer step. Restarted peers that already train on their old
outer step, when they are half the peers that serve, keep an honest minority that moved on while they were away
above the ceiling: to them it is what colluders claiming outer steps ahead are. And when peers that left alone
hold the swarm's last outer step, a peer restarted beside another restarted peer trains on with it. At the start of a
run, while the records show only us and one other peer, that peer is half the voters: if it claims the next outer step
on a hash of its own (not ours: `truthful`) serving that state, we take it.

Outer step claims are also bounded (`plausible`) for what does not go through the quorum: an outer step more than one
past the lower median of the other live peers' outer steps (with no other peer live, of the others' last commits)
is ignored for the group size and for the commits that decide when nobody else is live; and others are
`ready` (this peer stops its inner steps early to meet them) only when most live peers that may average this
outer step say so, so one peer claiming readiness from the start of every outer step cannot cut everyone's outer steps
short. A private swarm (`swarm.auth: allowlist`) keeps strangers out altogether.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Mapping, Optional, Sequence

from swarm.net import certificates
from swarm.net.schema import CommitRecord, ProgressRecord, RunRecord, Statement

Known = Callable[[int], Optional[frozenset[str]]]
"""The keys that vote on an outer step s (ledger.py `Ledger.known`); None for s: every identity votes."""


class Verdict(Enum):
    AVERAGE = "average"
    ALONE = "alone"
    BEHIND = "behind"
    DIVERGED = "diverged"
    UNSURE = "unsure"


@dataclass(frozen=True)
class Position:
    verdict: Verdict
    swarm_outer_step: int  # the highest outer step any peer committed, live or gone (ours at least)
    swarm_sha256: Optional[str]  # that outer step's winning hash
    expected_group: Optional[int]  # live peers that may average our outer step, us included (None: unsure)
    donors: tuple[str, ...] = ()  # BEHIND / DIVERGED: peer ids to take the state from, best first
    others_ready: bool = False  # most live peers that may average our outer step finished their inner steps
    note: str = ""
    ignored: tuple[str, ...] = ()  # peers whose outer step claims were false or implausible (`truthful`, `plausible`)
    uncertified: tuple[str, ...] = ()  # peers claiming an outer step ahead that no certificate backs (`uncertified`)
    credit: Mapping[str, int] = field(default_factory=dict)  # keys that signed grounded certificates read (Chains)


def is_live(record: ProgressRecord, now: float, window: float) -> bool:
    return now - record.time <= window


def votes_on(known: Optional[Known], outer_step: int) -> Callable[[str], bool]:
    """Whether a peer votes on `outer_step`: a key the ledger knows, or anyone where it knows nothing (a newcomer, a
    run's first outer step)."""
    keys = known(outer_step) if known is not None else None
    return (lambda peer: True) if keys is None else keys.__contains__


def _certifies(count: int, known: Optional[Known], outer_step: int) -> bool:
    """Whether `count` last commits certify a hash at `outer_step` while nobody else is live: with a ledger, at least
    half of the keys it knows for that outer step, as the quorum rule asks of live peers (one of three former
    groupmates, a lone survivor or a forger, is not); without, any (the most votes win)."""
    keys = known(outer_step) if known is not None else None
    return keys is None or 2 * count >= len(keys)


def _lower_median(values: list[int]) -> int:
    return sorted(values)[(len(values) - 1) // 2]


def truthful(me: str, progress: Sequence[ProgressRecord], held: Mapping[str, int]) -> list[ProgressRecord]:
    """The records that do not contradict what we hold (`held`: our hashes and their outer steps). A hash binds the
    count of rounds closed (swarm/state/statehash.py), so one hash names one outer step: another peer's record that
    puts a hash we hold at another outer step is false (a claim one outer step ahead on its real hash, while the swarm
    still shows few peers, would otherwise be half of them) and is dropped, as `plausible` drops an outer step too far
    ahead."""
    return [r for r in progress if r.peer_id == me or held.get(r.sha256, r.outer_step) == r.outer_step]


def plausible(me: str, progress: Sequence[ProgressRecord], commits: Mapping[str, CommitRecord], now: float,
              window: float) -> tuple[list[ProgressRecord], dict[str, CommitRecord]]:
    """The records whose outer step is at most one past the others' majority (ours are always kept). One outer step
    per other peer: its live progress record's, else its last commit's. With other peers live, the ceiling
    is one past the lower median of those outer steps, or of the live ones alone if that is higher (peers that
    left long ago do not hold back the live swarm). With nobody else live, one past the upper median of the
    last commits: a peer restarted after the swarm finished (its own former id among the commits, one outer step
    in) still learns how far the swarm got, and one forged commit among honest ones is still outvoted."""
    live = {r.peer_id: r.outer_step for r in progress if is_live(r, now, window) and r.peer_id != me}
    outer_steps = [*live.values(), *(c.outer_step for p, c in commits.items() if p != me and p not in live)]
    if not outer_steps:
        return list(progress), dict(commits)
    if live:
        ceiling = max(_lower_median(outer_steps), _lower_median(list(live.values()))) + 1
    else:
        ceiling = sorted(outer_steps)[len(outer_steps) // 2] + 1
    return ([r for r in progress if r.peer_id == me or r.outer_step <= ceiling],
            {p: c for p, c in commits.items() if p == me or c.outer_step <= ceiling})


def votes(progress: Sequence[ProgressRecord], commits: Mapping[str, CommitRecord], now: float,
          window: float, known: Optional[Known] = None) -> dict[int, Counter]:
    """Per outer step, how many peers vouch for each hash: live peers by their progress record, others by their last
    commit record (with `known`, only the keys that vote on that outer step)."""
    live = {r.peer_id: r for r in progress if is_live(r, now, window)}
    tally: dict[int, Counter] = defaultdict(Counter)
    for peer, record in [*live.items(), *((p, c) for p, c in commits.items() if p not in live)]:
        if record.sha256 and votes_on(known, record.outer_step)(peer):
            tally[record.outer_step][record.sha256] += 1
    return tally


def winner(counts: Counter) -> Optional[str]:
    """The hash with the most votes; ties go to the larger hash."""
    return max(counts, key=lambda h: (counts[h], h)) if counts else None


def ceiling(me: str, live: Sequence[ProgressRecord]) -> Optional[int]:
    """The highest outer step a claim may name: one past the lower median of the outer steps of the other live peers
    that serve their state (None: none does). A peer taking a state (a newcomer, a peer restarted from an old
    checkpoint) serves none meanwhile, so a burst of them does not drag it below the peers they catch up with;
    k peers claiming outer steps far ahead, k below half, leave it at an honest outer step."""
    outer_steps = sorted(r.outer_step for r in live if r.peer_id != me and r.serves_state)
    return outer_steps[(len(outer_steps) - 1) // 2] + 1 if outer_steps else None


def backing(progress: Sequence[ProgressRecord], commits: Mapping[str, CommitRecord],
            anchor: certificates.Anchor) -> certificates.Chains:
    """The certificates in the records read (each progress record's last statement, each commit record's last
    ones), grounded on `anchor`."""
    return certificates.chains([*((r.peer_id, r.statement) for r in progress),
                                *((p, st) for p, c in commits.items() for st in c.statements)], anchor)


PLURALITY = 2
"""Backed votes a lineage needs to win our own outer step without half of them: two, so that one peer's own statement
(a group of one) never outvotes another lone peer."""


def uncertified(me: str, outer_step: int, progress: Sequence[ProgressRecord], commits: Mapping[str, CommitRecord],
                now: float, window: float, backed: certificates.Chains) -> tuple[str, ...]:
    """The peers that claim an outer step past `outer_step` on a hash no certificate grounded on our lineage backs: by
    a live progress record (free identities voting ahead, a claim ahead on a hash we hold) or by their last
    commit record (a forged commit). An honest peer ahead holds what its group certified; these are the claims
    the quorum disregarded, named so that the peer's events say who made them. A claim its own signed statement
    backs while its group's certificate is still incomplete in what we read (`Chains.pending`: the first of a
    group to publish its commit) is not named."""
    claims = [*((r.peer_id, r.outer_step, r.sha256, [r.statement]) for r in progress if is_live(r, now, window)),
              *((p, c.outer_step, c.sha256, c.statements) for p, c in commits.items())]

    def lie(peer: str, s: int, sha: str, statements: Sequence[Optional[Statement]]) -> bool:
        own = next((st for st in statements if st is not None and (st.outer_step, st.sha256) == (s, sha)), None)
        return not backed.grounded(s, sha) and (own is None or not backed.pending(peer, own))
    return tuple(sorted({p for p, s, sha, statements in claims if p != me and s > outer_step and sha
                         and lie(p, s, sha, statements)}))


def certified(me: str, progress: Sequence[ProgressRecord], commits: Mapping[str, CommitRecord], now: float,
              window: float, known: Optional[Known] = None,
              backed: Optional[certificates.Chains] = None, own: Optional[int] = None) -> dict[int, str]:
    """Per outer step s, the hash the swarm committed there, by the quorum rule (module docstring): with `backed` (the
    certificates read, `backing`), only the votes they back count, and only they are the electorate; without,
    one identity one vote. At our own outer step `own`, with `backed`, where no hash holds half, the lineage most
    backed peers hold wins if at least two do (`PLURALITY`). With no other peer live (every other peer
    has left), the plausible last commits decide instead, by the keys `known` to this peer where it knows any
    (ledger.py: at least half of them), else the most votes winning."""
    progress = truthful(me, progress, {r.sha256: r.outer_step for r in progress if r.peer_id == me and r.sha256})
    live = [r for r in progress if is_live(r, now, window)]
    if not any(r.peer_id != me for r in live):
        progress, commits = plausible(me, progress, commits, now, window)
        tally = votes(progress, commits, now, window, known)
        return {s: best for s, counts in tally.items()
                if (best := winner(counts)) and _certifies(counts[best], known, s)}
    if backed is not None:
        live = [r for r in live if backed.counts(r.peer_id, r.outer_step, r.sha256)]
    top = ceiling(me, live)
    tally: dict[int, Counter] = defaultdict(Counter)
    for r in live:
        if r.sha256 and r.serves_state and (top is None or r.outer_step <= top):
            tally[r.outer_step][r.sha256] += 1
    out = {}
    for s, counts in tally.items():
        best = winner(counts)
        if 2 * counts[best] >= sum(1 for r in live if r.outer_step >= s - 1 or r.serves_state):
            out[s] = best
        elif s == own and backed is not None and counts[best] >= PLURALITY:
            out[s] = best
    return out


def assess(me: str, outer_step: int, sha256: str, progress: Sequence[ProgressRecord],
           commits: Mapping[str, CommitRecord], now: float, window: float,
           known: Optional[Known] = None, anchor: Optional[certificates.Anchor] = None) -> Position:
    claimed = {r.peer_id for r in progress} | set(commits)
    read = progress  # all of it: the claims `truthful` drops are named as uncertified too
    live_ids = {r.peer_id for r in progress if is_live(r, now, window)}
    held = ({r.sha256: r.outer_step for r in progress if r.peer_id == me and r.sha256}
            | ({sha256: outer_step} if sha256 else {}))
    progress = truthful(me, progress, held)
    backed = backing(progress, commits, anchor) if anchor is not None else None
    committed = certified(me, progress, commits, now, window, known, backed, own=outer_step)
    disregarded = () if backed is None else uncertified(me, outer_step, read, commits, now, window, backed)
    credit = {} if backed is None else backed.credit()
    holders = [r for r in progress if is_live(r, now, window) and r.peer_id != me and r.serves_state]
    progress, commits = plausible(me, progress, commits, now, window)
    ignored = tuple(sorted(claimed - {r.peer_id for r in progress} - set(commits)))
    unsure = len(live_ids - {r.peer_id for r in progress})  # live, at an outer step it does not tell: may join us
    live = [r for r in progress if is_live(r, now, window)]
    swarm_outer_step = max([outer_step, *committed])
    swarm_sha = committed.get(swarm_outer_step)
    if not any(r.peer_id == me for r in live):
        return Position(Verdict.UNSURE, swarm_outer_step, swarm_sha, None, note="progress records unreadable",
                        ignored=ignored, uncertified=disregarded, credit=credit)
    others = [r for r in live if r.peer_id != me]
    if swarm_outer_step > outer_step:
        donors = sorted(r.peer_id for r in holders if r.outer_step == swarm_outer_step and r.sha256 == swarm_sha)
        return Position(Verdict.BEHIND, swarm_outer_step, swarm_sha, None, tuple(donors),
                        note=f"behind: the swarm committed outer step {swarm_outer_step}, we hold outer step "
                             f"{outer_step}",
                        ignored=ignored, uncertified=disregarded, credit=credit)
    # peers an outer step ahead whose claim the quorum did not take may be at ours (the claim-ahead attack: left out
    # of the count, it closed our groups one member short, leaving an honest peer out)
    # (claims no certificate backs, on another hash than ours, are nobody we wait for: free identities; but a hash
    # of our own lineage says where its holder is, whatever outer step its record claims: a claim one outer step ahead
    # made between two commits, on the hash of the outer step before ours, is a groupmate a moment behind us; so is
    # a member of the group we committed our outer step with whose record still shows the step before, on our hash
    # of it, although no certificate of its own backs that (it took that state instead of averaging it))
    ours = {} if anchor is None else {sha: s for s, sha in anchor.lineage.items()}
    group = frozenset() if anchor is None else anchor.groups.get(outer_step, frozenset())

    def waits_for(r: ProgressRecord) -> bool:
        if backed is None or r.sha256 in (sha256, "") or backed.counts(r.peer_id, r.outer_step, r.sha256):
            return True
        at = ours.get(r.sha256)
        return at is not None and outer_step - 1 <= at <= outer_step and (backed.counts(r.peer_id, at, r.sha256)
                                                                          or r.peer_id in group)
    expected = sum(1 for r in live if outer_step - 1 <= r.outer_step <= outer_step + 1 and waits_for(r)) + unsure
    majority = committed.get(outer_step, sha256)
    if majority != sha256:
        donors = tuple(sorted(r.peer_id for r in holders if r.outer_step == outer_step and r.sha256 == majority))
        return Position(Verdict.DIVERGED, swarm_outer_step, swarm_sha, expected, donors,
                        note=f"most live peers at outer step {outer_step} hold other global parameters than ours "
                             f"({majority[:12]})", ignored=ignored, uncertified=disregarded, credit=credit)
    mates = [r for r in others if r.outer_step == outer_step and r.sha256 in (sha256, "")]
    # most of the others that may average this outer step (those still showing the outer step before count as not
    # ready: right after a commit, a forger claiming readiness may be the only one showing the new outer step)
    ready = 2 * sum(r.ready for r in mates) > expected - 1
    if not mates:
        return Position(Verdict.ALONE, swarm_outer_step, swarm_sha, expected, note="alone", ignored=ignored,
                        uncertified=disregarded, credit=credit)
    return Position(Verdict.AVERAGE, swarm_outer_step, swarm_sha, expected, others_ready=ready,
                    note=f"{len(mates)} live peers share outer step {outer_step}", ignored=ignored,
                    uncertified=disregarded, credit=credit)


def run_fingerprint(records: Mapping[str, RunRecord]) -> Optional[str]:
    """The fingerprint most peers of the run signed (ties: the one signed first), None for a new run. Each
    peer signs only its own record, so a stranger adds one vote and cannot replace anyone's."""
    signed: dict[str, list[float]] = {}
    for record in records.values():
        signed.setdefault(record.fingerprint, []).append(record.time)
    return min(signed, key=lambda fp: (-len(signed[fp]), min(signed[fp])), default=None)
