"""Who a peer averages with (swarm/net/grouping.py): offenders left out, the chunk size agreed."""

import pytest
from hivemind.p2p import PeerID

from swarm.net import access, grouping
from swarm.net.access import Access
from swarm.net.allreduce.groupstate import AllReduceFailed
from swarm.net.matchmaking import Group, NoGroup


def peer(i: int) -> PeerID:
    return PeerID(bytes([0, 1, i]))


def group(n: int, **meta) -> Group:
    return Group(b"g" * 16, [peer(i) for i in range(n)], [dict(meta) for _ in range(n)])


def test_an_offender_is_left_out_this_round_and_banned_after_two():
    offenses = grouping.Offenses(Access())
    g = group(4)
    assert offenses.exclude(g, outer_step=0) == (g, frozenset())
    offenses.record(peer(2), outer_step=0, reason="NaN")
    kept, dropped = offenses.exclude(g, outer_step=0)
    assert kept.members == [peer(0), peer(1), peer(3)] and len(kept.metas) == 3 and dropped == {str(peer(2))}
    assert kept.group_id != g.group_id
    assert offenses.exclude(g, outer_step=1) == (g, frozenset())  # one offense: back in the next round
    offenses.record(peer(2), outer_step=1, reason="NaN again")
    assert peer(2) not in offenses.exclude(g, outer_step=5)[0].members  # two: out for the run


def test_a_conclusive_offense_bans_at_once():
    """Non-finite values in a contribution (allreduce.CONCLUSIVE): no honest peer sends them, so one is enough.
    Banned at two, a NaN sender spoiled one attempt per honest owner, and with groups split that cost an honest
    peer a round (hostile bench, `nan` row: 3 of 4 rounds)."""
    offenses = grouping.Offenses(Access())
    offenses.record(peer(2), outer_step=0, reason="part contains NaN or Inf", conclusive=True)
    assert peer(2) not in offenses.exclude(group(4), outer_step=1)[0].members
    assert offenses.access.banned == {str(peer(2))}
    assert [e["event"] for e in offenses.access.events] == ["offense", "banned"]
    assert "at once, conclusive: part contains NaN or Inf" in offenses.access.events[-1]["what"]


def test_an_unproven_culprit_is_taken_back_at_the_next_attempt_a_proven_one_is_not():
    """Two honest peers blamed each other for a trickler's stall (unproven): left out for the round, each would
    stay alone and retry the discarded round for ever."""
    offenses = grouping.Offenses(Access())
    g = group(4)
    offenses.begin(0)
    offenses.record(peer(1), outer_step=0, reason="went silent", proven=False)
    offenses.record(peer(2), outer_step=0, reason="NaN")
    assert offenses.exclude(g, outer_step=0)[0].members == [peer(0), peer(3)]
    offenses.begin(0)  # the round was discarded: its retry
    assert offenses.exclude(g, outer_step=0)[0].members == [peer(0), peer(1), peer(3)]
    assert [e["event"] for e in offenses.access.events].count("offense") == 1


def test_unproven_culprits_are_taken_back_when_nobody_else_is_left():
    """The trickle attack: the honest peers blamed each other for its stalls (unproven) and the trickler is
    banned; left out of each other's groups, each stayed alone for the rest of the attempt (60 s, the round
    lost). Taken back when they are all that is left; a proven offender never is."""
    offenses = grouping.Offenses(Access())
    offenses.begin(0)
    offenses.record(peer(1), outer_step=0, reason="nothing arrived for 10 s", proven=False)
    offenses.record(peer(2), outer_step=0, reason="NaN")
    assert offenses.exclude(group(2), outer_step=0)[0].members == [peer(0), peer(1)]  # peer 1 back
    assert offenses.exclude(group(4), outer_step=0)[0].members == [peer(0), peer(1), peer(3)]  # still out: peer 2
    offenses.record(peer(1), outer_step=0, reason="went silent again", proven=False)
    assert offenses.exclude(group(4), outer_step=0)[0].members == [peer(0), peer(3)]  # others to average with


def test_peers_that_caught_the_same_offender_agree_on_the_new_group_id():
    a, b = grouping.Offenses(Access()), grouping.Offenses(Access())
    for o in (a, b):
        o.record(peer(1), outer_step=3, reason="bad length")
    assert a.exclude(group(3), 3)[0].group_id == b.exclude(group(3), 3)[0].group_id


def names(*ids: int) -> frozenset[str]:
    return frozenset(str(peer(i)) for i in ids)


@pytest.mark.parametrize("me, left_outs, expected", [
    # two of the three that stay (us apart: 0 and 1) left out 3: we run the group without 3, as they do
    (2, {0: (3,), 1: (3,)}, (3,)),
    # the offender's own say is no vote: it is outside the electorate
    (2, {0: (3,), 1: (3,), 3: (0,)}, (3,)),
    # one liar of four leaves out an honest peer: one of the two that stay is not more than half
    (2, {3: (0,)}, None),
    # ... nor of five: 1 of 3
    (2, {4: (0,)}, None),
    # the same two, in a group of five, are 2 of the 3 that stay
    (2, {0: (4,), 1: (4,)}, (4,)),
    # nobody adopts a set that holds itself, however many name it
    (3, {0: (3,), 1: (3,), 2: (3,)}, None),
    # votes for different sets do not add up
    (2, {0: (3,), 1: (3, 4)}, None),
    # a name that is not a member makes the set no subgroup of ours
    (2, {0: (9,), 1: (9,)}, None),
    (2, {}, None),
])
def test_a_left_out_set_is_adopted_only_from_more_than_half_of_those_that_stay(me, left_outs, expected):
    g = group(5 if any(4 in d or k == 4 for k, d in left_outs.items()) else 4)
    got = grouping.adopted(g, str(peer(me)), {str(peer(k)): names(*d) for k, d in left_outs.items()})
    assert got == (None if expected is None else names(*expected))


def test_an_adopted_group_has_the_id_of_those_that_left_the_offender_out():
    offenses = grouping.Offenses(Access())
    g = group(4)
    offenses.record(peer(3), outer_step=0, reason="NaN")
    theirs = offenses.exclude(g, outer_step=0)[0]
    ours = grouping.without(g, names(3))
    assert (ours.group_id, ours.members, ours.metas) == (theirs.group_id, theirs.members, theirs.metas)


def test_only_offenders_left_means_no_group():
    offenses = grouping.Offenses(Access())
    offenses.record(peer(1), outer_step=0, reason="x")
    with pytest.raises(NoGroup) as e:
        offenses.exclude(group(2), outer_step=0)
    assert e.value.left is not None


def test_memory_of_offenders_is_bounded(monkeypatch):
    monkeypatch.setattr(access, "MAX_TRACKED", 3)
    offenses = grouping.Offenses(Access())
    for i in range(10):
        offenses.record(peer(i), outer_step=0, reason="x")
    assert offenses.access.tracked == 3


def test_strangers_to_a_private_swarm_are_left_out():
    offenses = grouping.Offenses(Access(frozenset(str(peer(i)) for i in (0, 1, 3))))
    kept, _ = offenses.exclude(group(4), outer_step=0)
    assert kept.members == [peer(0), peer(1), peer(3)]
    assert [e["event"] for e in offenses.access.events] == []  # a stranger is refused, not an offender


@pytest.mark.parametrize("chunks, agreed", [([2**18, 2**17, 2**18], 2**17), ([2**10, 2**10], 2**10)])
def test_agreed_chunk_is_the_smallest(chunks, agreed):
    g = Group(b"g" * 16, [peer(i) for i in range(len(chunks))], [{"chunk": c} for c in chunks])
    assert grouping.agreed_chunk(g) == agreed


@pytest.mark.parametrize("bad", [None, 3000, 2**30, 2.0**17, True, "131072", 2**9])
def test_agreed_chunk_names_a_member_asking_for_nonsense(bad):
    g = Group(b"g" * 16, [peer(0), peer(1)], [{"chunk": 2**17}, {"chunk": bad}])
    with pytest.raises(AllReduceFailed) as e:
        grouping.agreed_chunk(g)
    assert e.value.culprit == peer(1)


def test_a_banned_members_garbage_base_is_never_read():
    """Offenders go first: their metadata (here an unhashable `base`) is not read by the majority vote."""
    offenses = grouping.Offenses(Access())
    offenses.record(peer(2), outer_step=0, reason="garbage")
    offenses.record(peer(2), outer_step=0, reason="garbage")
    g = Group(b"g" * 16, [peer(i) for i in range(3)], [{"base": "a"}, {"base": "a"}, {"base": ["x"]}])
    kept = grouping.on_majority_base(offenses.exclude(g, outer_step=1)[0], "a")
    assert kept.members == [peer(0), peer(1)]
