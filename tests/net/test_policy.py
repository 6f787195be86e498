"""policy.assess over tables of records: one row per situation a peer can find itself in."""

import pytest

from swarm.net.policy import Verdict, assess, votes, winner
from swarm.net.schema import CommitRecord, ProgressRecord

NOW, WINDOW = 1000.0, 10.0
A, B, C = "a" * 64, "b" * 64, "c" * 64


def progress(peer: str, round: int, sha: str = A, age: float = 1.0, ready: bool = False,
             serves: bool = True) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, name=peer, round=round, inner_step=0, samples=0, samples_per_s=0.0,
                          time=NOW - age, serves_state=serves, ready=ready, sha256=sha)


def commit(round: int, sha: str = A) -> CommitRecord:
    return CommitRecord(name="x", round=round, sha256=sha, time=NOW - 3600)


ME = "me"
# (situation, our round, our hash, progress records of others, commit records, verdict, donors, expected group)
TABLE = [
    ("alone in the swarm", 3, A, [], {}, Verdict.ALONE, (), 1),
    ("a groupmate at our round", 3, A, [progress("p", 3)], {}, Verdict.AVERAGE, (), 2),
    ("a groupmate still finishing the round before", 3, A, [progress("p", 2)], {}, Verdict.ALONE, (), 2),
    ("a live peer ahead", 3, A, [progress("p", 5, B)], {}, Verdict.BEHIND, ("p",), None),
    ("the highest round that half the voters hold", 3, A, [progress("p", 4, B), progress("q", 5, C),
                                                           progress("r", 5, C)], {}, Verdict.BEHIND, ("q", "r"), None),
    ("ahead peers on two hashes, neither held by half of the voters: no verdict on them", 3, A,
     [progress("p", 4, B), progress("q", 5, C)], {}, Verdict.ALONE, (), 2),
    ("an ahead peer that serves no state is no vote (nor could it give its state)", 3, A,
     [progress("p", 5, B, serves=False)], {}, Verdict.ALONE, (), 1),
    ("an ahead peer that serves no state among those that do is no donor", 3, A,
     [progress("p", 5, B, serves=False), progress("q", 5, B), progress("r", 5, B)], {}, Verdict.BEHIND,
     ("q", "r"), None),
    ("everyone ahead has left: behind, no donor", 3, A, [], {"gone": commit(10, B)}, Verdict.BEHIND, (), None),
    ("a dead peer's stale record ahead still counts through its commit", 3, A, [progress("p", 9, B, age=60)],
     {"p": commit(9, B)}, Verdict.BEHIND, (), None),
    ("a dead peer's stale record at our round is no groupmate", 3, A, [progress("p", 3, age=60)], {},
     Verdict.ALONE, (), 1),
    ("an ahead peer on a minority hash is no donor", 3, A, [progress("p", 5, B), progress("q", 5, C),
                                                          progress("r", 5, C)], {}, Verdict.BEHIND, ("q", "r"), None),
    ("most live peers at our round hold another hash", 3, A, [progress("p", 3, B), progress("q", 3, B)], {},
     Verdict.DIVERGED, ("p", "q"), 3),
    ("we are the majority", 3, A, [progress("p", 3, A), progress("q", 3, B)], {}, Verdict.AVERAGE, (), 3),
    ("a tie goes to the larger hash (theirs)", 3, A, [progress("p", 3, B)], {}, Verdict.DIVERGED, ("p",), 2),
    ("a tie goes to the larger hash (ours)", 3, B, [progress("p", 3, A)], {}, Verdict.ALONE, (), 2),
    ("commits of rounds we passed do not matter", 3, A, [progress("p", 3)], {"old": commit(2, C)},
     Verdict.AVERAGE, (), 2),
]


@pytest.mark.parametrize("situation,round,sha,others,commits,verdict,donors,expected", TABLE,
                         ids=[row[0] for row in TABLE])
def test_assess(situation, round, sha, others, commits, verdict, donors, expected):
    position = assess(ME, round, sha, [progress(ME, round, sha), *others], commits, NOW, WINDOW)
    assert position.verdict == verdict, position.note
    assert position.donors == donors
    assert position.expected_group == expected


def test_a_read_that_misses_our_own_record_decides_nothing():
    position = assess(ME, 3, A, [progress("p", 9, B)], {}, NOW, WINDOW)
    assert position.verdict == Verdict.UNSURE and position.expected_group is None


def test_others_ready_only_counts_live_groupmates_on_our_hash():
    me = progress(ME, 3)
    assert assess(ME, 3, A, [me, progress("p", 3, ready=True)], {}, NOW, WINDOW).others_ready
    assert not assess(ME, 3, A, [me, progress("p", 3, ready=True, age=60)], {}, NOW, WINDOW).others_ready
    assert not assess(ME, 3, A, [me, progress("p", 2, ready=True)], {}, NOW, WINDOW).others_ready
    assert not assess(ME, 3, A, [me, progress("p", 3, A), progress("q", 3, B, ready=True)], {}, NOW,
                      WINDOW).others_ready


def test_the_swarm_round_and_its_hash_come_from_live_records_and_commits():
    me = progress(ME, 3)
    position = assess(ME, 3, A, [me, progress("p", 4, B)], {"x": commit(6, C), "y": commit(6, C)}, NOW, WINDOW)
    assert position.swarm_outer_step == 4 and position.swarm_sha256 == B  # others live: their word, not the commits
    position = assess(ME, 3, A, [me], {"x": commit(6, C), "y": commit(6, C)}, NOW, WINDOW)
    assert position.swarm_outer_step == 6 and position.swarm_sha256 == C  # nobody else live: the commits
    tally = votes([progress("p", 4, B), progress("q", 4, C, age=60)], {"q": commit(4, C), "r": commit(4, C)},
                  NOW, WINDOW)
    assert winner(tally[4]) == C  # one vote per peer: p live (B); q and r by their commits (C, C)


FORGED = 2**40
# (situation, progress records of others, commit records, the swarm round we see, verdict)
CLAIMS = [
    ("a forger claims a far-future round among live peers", [progress("p", 3), progress("q", 3),
                                                             progress("evil", FORGED, C)], {}, 3, Verdict.AVERAGE),
    ("a forged far-future commit at the run's start", [progress("p", 3)], {"evil": commit(FORGED, C)}, 3,
     Verdict.AVERAGE),
    ("a forged commit among peers that left", [], {"x": commit(6), "y": commit(6), "evil": commit(FORGED, C)}, 6,
     Verdict.BEHIND),
    ("restarted after the swarm finished, our former id among the commits", [],
     {"former-me": commit(1), "a": commit(4)}, 4, Verdict.BEHIND),
    ("live peers one round ahead are believed", [progress("p", 4, B), progress("q", 4, B)], {}, 4, Verdict.BEHIND),
    ("live peers far ahead (we restarted late) are believed", [progress("p", 9, B), progress("q", 9, B)], {}, 9,
     Verdict.BEHIND),
    ("peers that left long ago do not hold back the live swarm", [progress("p", 5, B), progress("q", 5, B)],
     {f"old{i}": commit(1) for i in range(6)}, 5, Verdict.BEHIND),
]


@pytest.mark.parametrize("situation,others,commits,swarm_round,verdict", CLAIMS, ids=[row[0] for row in CLAIMS])
def test_implausible_round_claims_are_ignored(situation, others, commits, swarm_round, verdict):
    position = assess(ME, 3, A, [progress(ME, 3), *others], commits, NOW, WINDOW)
    assert (position.swarm_outer_step, position.verdict) == (swarm_round, verdict), position.note
    assert "evil" not in position.donors


def test_one_peer_claiming_readiness_does_not_cut_the_round_short():
    me, mates = progress(ME, 3), [progress("p", 3), progress("q", 3)]
    assert not assess(ME, 3, A, [me, *mates, progress("evil", 3, ready=True)], {}, NOW, WINDOW).others_ready
    ready = [progress("p", 3, ready=True), progress("q", 3)]
    assert assess(ME, 3, A, [me, *ready, progress("evil", 3, ready=True)], {}, NOW, WINDOW).others_ready


def test_a_live_peer_with_an_implausible_claim_still_counts_for_the_group_size():
    """It may be at our round and join our group (a forger flapping between rounds does): the leader waits
    for it rather than closing the group without an honest peer."""
    me, mates = progress(ME, 3), [progress("p", 3), progress("q", 2, B)]
    position = assess(ME, 3, A, [me, *mates, progress("evil", FORGED, C)], {}, NOW, WINDOW)
    assert position.expected_group == 4 and position.ignored == ("evil",)


def test_a_forger_with_a_plausible_commit_still_counts_for_the_group_size():
    """Its progress record claims round 2**40 but its commit record is at our round: it is live and may join."""
    me, mates = progress(ME, 3), [progress("p", 3), progress("q", 3)]
    position = assess(ME, 3, A, [me, *mates, progress("evil", FORGED, C)], {"evil": commit(3)}, NOW, WINDOW)
    assert position.expected_group == 4


def test_right_after_a_commit_a_forger_alone_at_the_new_round_is_no_majority():
    """The others still show the round before (they have not re-published yet): they count as not ready."""
    me, others = progress(ME, 3), [progress("p", 2), progress("q", 2)]
    assert not assess(ME, 3, A, [me, *others, progress("evil", 3, ready=True)], {}, NOW, WINDOW).others_ready


EVIL = ("evil", "evil2")
# The quorum rule against k peers acting together, k below half of the voters (module docstring of policy.py):
# (situation, progress records of others, commit records, verdict, donors)
QUORUM = [
    ("claim one round ahead (issue 21, attack 1): one voter of four", [progress("p", 3), progress("q", 3),
                                                                      progress("evil", 4, C)], {},
     Verdict.AVERAGE, ()),
    ("two colluders of five claim the next round", [progress("p", 3), progress("q", 3), progress("evil", 4, C),
                                                   progress("evil2", 4, C)], {}, Verdict.AVERAGE, ()),
    ("two colluders of five claim a round far ahead", [progress("p", 3), progress("q", 3),
                                                      progress("evil", 9, C), progress("evil2", 9, C)], {},
     Verdict.AVERAGE, ()),
    ("a forged commit one round ahead from a peer that is not live (attack 2)",
     [progress("p", 3), progress("q", 3)], {"evil": commit(4, C)}, Verdict.AVERAGE, ()),
    ("many forged commits ahead from identities that are not live", [progress("p", 3), progress("q", 3)],
     {f"evil{i}": commit(4, C) for i in range(20)}, Verdict.AVERAGE, ()),
    ("two colluders of five hold another hash at our round", [progress("p", 3), progress("q", 3),
                                                             progress("evil", 3, C), progress("evil2", 3, C)], {},
     Verdict.AVERAGE, ()),
    ("colluders that serve nothing are no voters either", [progress("p", 3), progress("evil", 4, C, serves=False),
                                                          progress("evil2", 4, C, serves=False)], {},
     Verdict.AVERAGE, ()),
    ("an honest split in two halves: the larger hash wins the tie", [progress("p", 3, A), progress("q", 3, B),
                                                                     progress("r", 3, B)], {},
     Verdict.DIVERGED, ("q", "r")),
    ("half the swarm moved on: the other half follows", [progress("p", 3), progress("q", 4, B),
                                                         progress("r", 4, B)], {}, Verdict.BEHIND, ("q", "r")),
    ("the claimant alone beside us, as at the start of a run, on the hash we hold at the round before: false",
     [progress("evil", 4, A)], {}, Verdict.ALONE, ()),
    ("a burst of newcomers taking a state does not outvote the peers they catch up with",
     [progress(f"new{i}", 3, serves=False) for i in range(4)] + [progress("p", 9, B), progress("q", 9, B)], {},
     Verdict.BEHIND, ("p", "q")),
]


def test_a_claim_one_round_ahead_still_counts_for_the_group_size():
    """The claimant may be at our round and join our group: without it in the count, our groups closed one member
    short of the swarm and left an honest peer out of the round (seen in tests/test_agreement.py)."""
    others = [progress("p", 3), progress("q", 3), progress("evil", 4, C)]
    assert assess(ME, 3, A, [progress(ME, 3), *others], {}, NOW, WINDOW).expected_group == 4


@pytest.mark.parametrize("situation,others,commits,verdict,donors", QUORUM, ids=[row[0] for row in QUORUM])
def test_the_quorum_rule(situation, others, commits, verdict, donors):
    position = assess(ME, 3, A, [progress(ME, 3), *others], commits, NOW, WINDOW)
    assert position.verdict == verdict, position.note
    assert position.donors == donors
    assert not set(EVIL) & set(position.donors) and position.swarm_sha256 != C


# Alone, by the keys the ledger knows (swarm/net/ledger.py): ME averaged rounds 1..3 with p and q, so each of us
# has a vote and a key we never averaged with has none. (situation, progress of others, commits, verdict)
SYBILS = [f"sybil{i}" for i in range(8)]
LEDGER = {1: {ME, "p", "q"}, 2: {ME, "p", "q"}, 3: {ME, "p", "q"}}
ALONE = [
    ("every groupmate gone: a forged commit one round ahead (forged-commit-alone)",
     {"p": commit(3), "q": commit(3), "evil": commit(4, C)}, Verdict.ALONE),
    ("8 forged commits ahead from fresh keys", {"p": commit(3), **{s: commit(4, C) for s in SYBILS}}, Verdict.ALONE),
    ("one former groupmate's commit one round ahead (a lone survivor's, or a forger's) is no quorum",
     {"p": commit(4, C), "q": commit(3)}, Verdict.ALONE),
    ("after the swarm finished: our groupmates' last commits are further on", {"p": commit(6, B), "q": commit(6, B)},
     Verdict.BEHIND),
]


def ledger_known(round: int):
    before = [s for s in LEDGER if s < round]
    return frozenset().union(*(LEDGER[s] for s in before)) if before else None


@pytest.mark.parametrize("situation,commits,verdict", ALONE, ids=[row[0] for row in ALONE])
def test_alone_only_keys_that_took_part_with_us_vote(situation, commits, verdict):
    position = assess(ME, 3, A, [progress(ME, 3)], commits, NOW, WINDOW, ledger_known)
    assert (position.verdict, position.donors) == (verdict, ()), position.note
    assert position.swarm_sha256 != C
    without = assess(ME, 3, A, [progress(ME, 3)], commits, NOW, WINDOW)  # nothing known: the most votes win
    assert without.verdict == Verdict.BEHIND
