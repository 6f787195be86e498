"""Certificates (swarm/net/certificates.py) and the quorum that counts only the votes they back (policy.py), over
tables of statements and records: free identities weigh nothing, honest groups that split still count each other."""

import pytest

from swarm.net.certificates import Anchor, Chains, gather
from swarm.net.policy import Verdict, assess
from swarm.net.schema import CommitRecord, ProgressRecord, Statement

NOW, WINDOW = 1000.0, 10.0
H = {s: f"{s:x}".rjust(64, "0") for s in range(40)}  # the honest lineage: H[s] at outer step s
X, Y = "e" * 64, "f" * 64  # other hashes
ME, HONEST = "me", ["me", "p", "q"]
SYBILS = [f"sybil{i}" for i in range(8)]


def st(round: int, sha: str, parent: str, group: str = "aa", size: int = 3) -> Statement:
    return Statement(round=round, parent=parent, sha256=sha, group=group, size=size)


def honest_history(upto: int, members=HONEST) -> list[tuple[str, Statement]]:
    """`members` averaged every outer step 1..upto in one group, on the lineage H."""
    return [(m, st(s, H[s], H[s - 1], group=f"{s:02x}", size=len(members))) for s in range(1, upto + 1) for m in members]


LINEAGE = Anchor({s: H[s] for s in range(0, 4)}, frozenset(HONEST))  # ME held H[0..3], founded with p, q


def test_a_certificate_is_at_least_half_of_its_group():
    certs = gather([("p", st(1, X, H[0], size=4)), ("q", st(1, X, H[0], size=4)),
                    ("r", st(1, Y, H[0], group="bb", size=4))])
    assert certs[(1, X)].signers == {"p", "q"}
    assert (1, Y) not in certs  # one of a group of 4 certifies nothing


# (situation, statements read, the vote asked about (peer, outer step, hash), counts for ME)
COUNTS = [
    ("an honest groupmate at our outer step", honest_history(3), ("p", 3, H[3]), True),
    ("8 fresh keys certifying the next step on our parent", [*honest_history(3), *((s, st(4, X, H[3], size=8))
                                                                                 for s in SYBILS)],
     ("sybil0", 4, X), False),
    ("8 fresh keys that forged two steps of a chain off ours", [*honest_history(3),
                                                               *((s, st(3, Y, H[2], "b1", 8)) for s in SYBILS),
                                                               *((s, st(4, X, Y, "b2", 8)) for s in SYBILS)],
     ("sybil0", 4, X), False),
    ("a claim with no statement", honest_history(3), ("sybil0", 4, X), False),
    ("an honest group that split from our parent counts (credited on it)",
     [*honest_history(2, ["me", "p", "q", "r"]), ("q", st(3, X, H[2], "cc", 2)), ("r", st(3, X, H[2], "cc", 2))],
     ("r", 3, X), True),
    ("a newcomer that took our state votes for it once credited: here, not yet", honest_history(3), ("n", 3, H[3]),
     False),
    ("a groupmate that took the next step's state from its group", [*honest_history(3), ("q", st(4, X, H[3], "dd", 2)),
                                                                   ("r", st(4, X, H[3], "dd", 2))],
     ("p", 4, X), True),
    ("the initial state counts for everyone", [], ("anyone", 0, H[0]), True),
]


@pytest.mark.parametrize("situation,statements,vote,counts", COUNTS, ids=[row[0] for row in COUNTS])
def test_which_votes_count(situation, statements, vote, counts):
    assert Chains(gather(statements), LINEAGE).counts(*vote) is counts


def test_a_newcomer_counts_a_chain_without_statements_for_nobody():
    """With no lineage, a certificate is grounded by its parent's: claims without statements never count, an
    honest chain does (the fabricated two-step chain would: certificates.py says so)."""
    chains = Chains(gather(honest_history(3)), Anchor({0: H[0]}))
    assert chains.counts("p", 3, H[3])
    assert not chains.counts("sybil0", 4, X)


def record(peer: str, round: int, sha: str, statement=None, serves=True) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, name=peer, round=round, inner_step=0, samples=0, samples_per_s=0.0,
                          time=NOW - 1.0, serves_state=serves, sha256=sha, statement=statement)


def commits(history) -> dict[str, CommitRecord]:
    out: dict[str, list] = {}
    for peer, statement in history:
        out.setdefault(peer, []).append(statement)
    return {p: CommitRecord(name=p, round=s[-1].round, sha256=s[-1].sha256, time=NOW - 5, statements=s)
            for p, s in out.items()}


def sybil_quorum():
    """Three honest peers at outer step 3 and 8 fresh keys claiming step 4 on a perturbed hash, serving it."""
    honest = [record(p, 3, H[3], st(3, H[3], H[2], "03", 3)) for p in HONEST]
    return honest, [record(s, 4, X) for s in SYBILS], commits(honest_history(3))


def test_sybil_quorum_steers_no_peer_with_a_lineage():
    honest, sybils, done = sybil_quorum()
    position = assess(ME, 3, H[3], [*honest, *sybils], done, NOW, WINDOW, anchor=LINEAGE)
    assert position.verdict == Verdict.AVERAGE and position.expected_group == 3, position.note
    without = assess(ME, 3, H[3], [*honest, *sybils], done, NOW, WINDOW)  # one identity one vote
    assert without.verdict == Verdict.BEHIND


def test_a_claim_ahead_on_the_hash_of_the_round_before_still_counts_for_the_group_size():
    """claim-ahead between two commits: the attacker's record says outer step 3 on H[2], the hash it really holds
    (it has not committed 3 yet). Left out of the count, our groups closed one member short and an honest peer a
    moment behind missed the round (tests/test_agreement.py, 2 runs in 17). Its hash says where it is: at step 2,
    certified there, so it is waited for; a fresh key making the same claim is not."""
    honest = [record(p, 3, H[3], st(3, H[3], H[2], "03", 4)) for p in HONEST]
    history = honest_history(2, [*HONEST, "evil"])
    done = commits([*history, *((p, st(3, H[3], H[2], "03", 4)) for p in HONEST)])
    claim = record("evil", 3, H[2], st(2, H[2], H[1], "02", 4))
    position = assess(ME, 3, H[3], [*honest, claim], done, NOW, WINDOW, anchor=LINEAGE)
    assert position.expected_group == 4, position.note
    fresh = record("sybil0", 3, H[2])
    position = assess(ME, 3, H[3], [*honest, fresh], done, NOW, WINDOW, anchor=LINEAGE)
    assert position.expected_group == 3, position.note


def test_a_groupmate_whose_record_lags_a_step_behind_on_a_state_it_took_is_waited_for():
    """A joiner took our state of outer step 1 (no certificate of its own backs it there), averaged step 2 with us,
    and its record still shows step 1 while it lands that commit: it is a groupmate a moment behind, waited for
    (expected 2), where a fresh key showing the same is not (a lone peer that has averaged goes on alone). Missed,
    a peer with 4 ranks closed the last round of a swarm alone and its slower 2-rank groupmate took the state
    again (tests/test_sharding.py, under a loaded machine)."""
    mine = [st(1, H[1], H[0], "", 1), st(2, H[2], H[1], "02", 2)]
    done = {**commits([(ME, s) for s in mine]), "joiner": CommitRecord(name="joiner", round=1, sha256=H[1],
                                                                       time=NOW - 5)}
    records = [record(ME, 2, H[2], mine[-1]), record("joiner", 1, H[1])]
    lineage = {s: H[s] for s in range(0, 3)}
    position = assess(ME, 2, H[2], records, done, NOW, WINDOW,
                      anchor=Anchor(lineage, frozenset({ME}), groups={2: frozenset({ME, "joiner"})}))
    assert (position.verdict, position.expected_group) == (Verdict.ALONE, 2), position.note
    position = assess(ME, 2, H[2], records, done, NOW, WINDOW, anchor=Anchor(lineage, frozenset({ME})))
    assert (position.verdict, position.expected_group) == (Verdict.ALONE, 1), position.note


def test_sybil_quorum_steers_no_newcomer():
    honest, sybils, done = sybil_quorum()
    newcomer = record("n", 0, "", serves=False)
    position = assess("n", 0, "", [newcomer, *honest, *sybils], done, NOW, WINDOW, anchor=Anchor({}))
    assert (position.verdict, position.swarm_outer_step, position.swarm_sha256) == (Verdict.BEHIND, 3, H[3])
    assert position.donors == tuple(sorted(HONEST))


def test_two_groups_that_split_from_one_parent_settle_on_one_hash():
    """Four peers, one group up to step 2, then groups {me, p} and {q, r}: each side counts the other (both
    credited on the parent) and the tie goes to the larger hash on both sides: one is DIVERGED, the other not."""
    four = ["me", "p", "q", "r"]
    history = [*honest_history(2, four), *((m, st(3, X, H[2], "c1", 2)) for m in ("me", "p")),
               *((m, st(3, Y, H[2], "c2", 2)) for m in ("q", "r"))]
    records = [*(record(m, 3, X, st(3, X, H[2], "c1", 2)) for m in ("me", "p")),
               *(record(m, 3, Y, st(3, Y, H[2], "c2", 2)) for m in ("q", "r"))]
    founded = frozenset(four)
    ours = assess("me", 3, X, records, commits(history), NOW, WINDOW, anchor=Anchor({**LINEAGE.lineage, 3: X}, founded))
    theirs = assess("q", 3, Y, records, commits(history), NOW, WINDOW, anchor=Anchor({**LINEAGE.lineage, 3: Y}, founded))
    assert (ours.verdict, ours.donors) == (Verdict.DIVERGED, ("q", "r"))
    assert theirs.verdict == Verdict.AVERAGE


def test_forged_statements_over_thousands_of_outer_steps_neither_recurse_nor_count():
    """One key per outer step 1..5000, each a certificate on the last: read in order, no recursion; none counts."""
    forged = [(f"k{s}", st(s, f"{s:x}".rjust(64, "a"), f"{s - 1:x}".rjust(64, "a"), size=1)) for s in range(1, 5000)]
    chains = Chains(gather([*honest_history(3), *forged]), LINEAGE)
    assert not chains.counts("k4999", 4999, f"{4999:x}".rjust(64, "a"))
    assert chains.counts("p", 3, H[3])


def test_groups_that_split_from_the_initial_state_count_each_other_by_the_founders():
    """Round 1 in groups {me, p} and {q, r}; {me, p} took the other side's state, then both sides committed
    outer step 2 on it again in the same halves (the split that the e2e test of four peers in groups of two
    meets): the founders ground the other half's first certificate, so its second counts as well."""
    history = [*((m, st(1, X, H[0], "a1", 2)) for m in ("me", "p")), *((m, st(1, Y, H[0], "a2", 2)) for m in ("q", "r")),
               *((m, st(2, H[2], Y, "b1", 2)) for m in ("me", "p")), *((m, st(2, H[3], Y, "b2", 2)) for m in ("q", "r"))]
    anchor = Anchor({0: H[0], 1: Y, 2: H[3]}, frozenset({"me", "p", "q", "r"}))
    assert Chains(gather(history), anchor).counts("me", 2, H[2])
    assert not Chains(gather(history), Anchor(anchor.lineage, frozenset({"q", "r"}))).counts("me", 2, H[2])


def test_a_ladder_of_forged_statements_from_the_initial_state_grounds_nothing_for_a_peer_with_a_lineage():
    """8 fresh keys sign outer step 1 off the initial state, then every WINDOW steps one more: each rung would be
    credited by the one before, but the first is not: they were no founders, and it is not our lineage."""
    rungs = [1, 17, 33]
    ladder = [(s, st(r, f"{r:x}".rjust(64, "b"), H[0] if r == 1 else f"{r - 1:x}".rjust(64, "b"), f"{r:02x}", 8))
              for r in rungs for s in SYBILS]
    anchor = Anchor({s: H[s] for s in range(0, 33)}, frozenset(HONEST))
    chains = Chains(gather([*honest_history(33)[-3 * 16:], *ladder]), anchor)
    assert not chains.counts("sybil0", 33, f"{33:x}".rjust(64, "b"))
    assert chains.counts("p", 33, H[33])


def split_in_three(sizes=(3, 2, 2), shas=(X, Y, H[9])):
    """Seven peers in one group up to step 2, then step 3 in groups of `sizes` on `shas`: no hash holds half."""
    names = [f"p{i}" for i in range(sum(sizes))]
    groups, start = [], 0
    for size, sha in zip(sizes, shas):
        groups.append((names[start:start + size], sha))
        start += size
    history = [*honest_history(2, names), *((m, st(3, sha, H[2], f"c{sha[-1]}", len(ms)))
                                            for ms, sha in groups for m in ms)]
    records = [record(m, 3, sha, st(3, sha, H[2], f"c{sha[-1]}", len(ms))) for ms, sha in groups for m in ms]
    return groups, records, commits(history), frozenset(names)


def test_at_our_own_round_the_lineage_most_backed_peers_hold_wins_without_half():
    """A churn split (bench/results §9): 3, 2 and 2 of seven peers on three hashes at step 3. Every side names the
    lineage of 3; free identities voting a fourth hash at that round tip nothing."""
    groups, records, done, founded = split_in_three()
    sybils = [record(s, 3, H[8]) for s in SYBILS]
    for members, sha in groups:
        anchor = Anchor({0: H[0], 1: H[1], 2: H[2], 3: sha}, founded)
        position = assess(members[0], 3, sha, [*records, *sybils], done, NOW, WINDOW, anchor=anchor)
        if sha == X:
            assert position.verdict == Verdict.AVERAGE, position.note
        else:
            assert (position.verdict, position.donors) == (Verdict.DIVERGED, tuple(groups[0][0])), position.note


def test_a_tie_of_lineages_goes_to_the_larger_hash_and_one_lone_peer_outvotes_nobody():
    groups, records, done, founded = split_in_three((2, 2, 1), (X, Y, H[9]))
    sides = {sha: assess(ms[0], 3, sha, records, done, NOW, WINDOW, anchor=Anchor({0: H[0], 2: H[2], 3: sha}, founded))
             for ms, sha in groups}
    assert [sides[sha].verdict for sha in (X, Y, H[9])] == [Verdict.DIVERGED, Verdict.AVERAGE, Verdict.DIVERGED]
    groups, records, done, founded = split_in_three((1, 1, 1), (X, Y, H[9]))
    lone = assess("p0", 3, X, records, done, NOW, WINDOW, anchor=Anchor({0: H[0], 2: H[2], 3: X}, founded))
    assert lone.verdict == Verdict.ALONE, lone.note


def test_a_round_ahead_still_needs_half_of_the_peers():
    """The first small group to commit the next step does not pull the peers still averaging ours."""
    groups, records, done, founded = split_in_three((3, 2, 2), (X, Y, H[9]))
    ahead = [record(m, 4, H[10], st(4, H[10], X, "d4", 2)) for m in groups[0][0][:2]]
    done = {**done, **{r.peer_id: CommitRecord(name=r.peer_id, round=4, sha256=H[10], time=NOW - 1,
                                               statements=[*done[r.peer_id].statements, r.statement]) for r in ahead}}
    kept = [r for r in records if r.peer_id not in {a.peer_id for a in ahead}]
    position = assess("p3", 3, Y, [*kept, *ahead], done, NOW, WINDOW,
                      anchor=Anchor({0: H[0], 2: H[2], 3: Y}, founded))
    assert position.verdict != Verdict.BEHIND, position.note


def test_claims_ahead_that_no_certificate_backs_are_named_and_honest_ones_are_not():
    """sybil-quorum's keys, a claim of the next step on our own hash (claim-ahead) and a forged commit record are
    named (the peer's events say who); a groupmate that committed the next step with its group is not."""
    honest, sybils, done = sybil_quorum()
    ahead = [record("p", 4, H[4], st(4, H[4], H[3], "04", 2)), record("q", 4, H[4], st(4, H[4], H[3], "04", 2))]
    liar = record("r", 4, H[3])  # our hash, a step further
    forged = {"f": CommitRecord(name="f", round=4, sha256=Y, time=NOW - 1, statements=done["p"].statements)}
    position = assess(ME, 3, H[3], [honest[0], *ahead, liar, *sybils], {**done, **forged}, NOW, WINDOW,
                      anchor=LINEAGE)
    assert position.uncertified == tuple(sorted(["f", "r", *SYBILS]))
    assert assess(ME, 3, H[3], [*honest, *sybils], done, NOW, WINDOW).uncertified == ()  # no anchor: not judged


def test_a_lineage_that_split_longer_ago_than_the_records_reach_stays_grounded_by_what_we_saw():
    """{me, p} and {q, r} split at step 3 and go on apart to step 30 (the churn soak's three lineages): the records
    carry the last 16 statements, so the common parent is gone, and the other half's certificates ground only on
    the credit this peer remembered from an earlier reading, while the parent was still in the records."""
    four, ours, theirs = ["me", "p", "q", "r"], {s: f"{s:x}".rjust(64, "c") for s in range(40)}, \
        {s: f"{s:x}".rjust(64, "d") for s in range(40)}
    history = [*honest_history(2, four),
               *((m, st(s, ours[s], ours[s - 1] if s > 3 else H[2], f"a{s:02x}", 2)) for s in range(3, 31)
                 for m in ("me", "p")),
               *((m, st(s, theirs[s], theirs[s - 1] if s > 3 else H[2], f"b{s:02x}", 2)) for s in range(3, 31)
                 for m in ("q", "r"))]
    lineage = {**{s: H[s] for s in range(3)}, **{s: ours[s] for s in range(3, 31)}}
    early = Chains(gather([st for st in history if st[1].round <= 12]), Anchor(lineage, frozenset(four)))
    seen = early.credit()
    assert seen["q"] == 12 and seen["me"] == 12
    late = [st for st in history if st[1].round > 16]  # what the records still carry at step 30 (and more)
    assert not Chains(gather(late), Anchor(lineage, frozenset(four))).counts("q", 30, theirs[30])
    remembered = Chains(gather([st for st in history if 12 < st[1].round <= 26]), Anchor(lineage, frozenset(four), seen))
    assert remembered.counts("q", 26, theirs[26])  # a reading in between refreshes the credit...
    at_30 = Chains(gather(late), Anchor(lineage, frozenset(four), remembered.credit()))
    assert at_30.counts("q", 30, theirs[30]) and at_30.counts("p", 30, ours[30])
    assert not at_30.counts("sybil0", 30, X)


def test_the_first_of_a_group_to_publish_its_commit_is_not_named_before_its_groupmates_publish():
    """Right after a group of three commits outer step 4, p's record shows it with p's statement while q's and ours
    still show step 3: no certificate of step 4 yet, so p's vote does not count, but p is no liar. A newcomer
    reading the same moment (no lineage) does not name it either; a fresh key making the same claim is named."""
    honest, sybils, done = sybil_quorum()
    first = record("p", 4, H[4], st(4, H[4], H[3], "04", 3))
    fresh = record("sybil0", 4, H[4], st(4, H[4], H[3], "05", 3))  # a group of its own
    records = [honest[0], first, honest[2], fresh]
    position = assess(ME, 3, H[3], records, done, NOW, WINDOW, anchor=LINEAGE)
    assert position.uncertified == ("sybil0",)
    newcomer = assess("n", 0, H[0], [*records, record("n", 0, H[0])], done, NOW, WINDOW, anchor=Anchor({0: H[0]}))
    assert "p" not in newcomer.uncertified
