"""The lease policy (swarm/data/leases.py) over tables: who keeps a shard, where a newcomer goes, what happens with more
peers than shards."""

import pytest

from swarm.data.leases import Claim, choose_shard, precedes, sharing

A, B, C = "peer-a", "peer-b", "peer-c"


@pytest.mark.parametrize("case, num_shards, me, since, preferred, others, usage, expected", [
    ("a newcomer in an empty swarm takes an unused shard", 4, A, 10.0, None, [], {}, None),
    ("a newcomer never takes a live peer's shard", 2, C, 10.0, None, [Claim(A, 0, 1.0)], {}, 1),
    ("the least-used free shard", 3, C, 10.0, None, [Claim(A, 0, 1.0)], {1: 500, 2: 20}, 2),
    ("a dead peer's shard is free again (its lease is not among the live)", 2, C, 10.0, None,
     [Claim(A, 0, 1.0)], {1: 800}, 1),
    ("a peer keeps its own shard", 3, A, 1.0, 2, [Claim(B, 0, 5.0)], {}, 2),
    ("a restarted peer takes its shard back from a later claimant", 3, A, 1.0, 2, [Claim(B, 2, 5.0)], {2: 90}, 2),
    ("a later claimant of a shard moves to the free one", 2, B, 5.0, 1, [Claim(A, 1, 1.0)], {1: 90}, 0),
    ("equal since: the smaller peer id keeps the shard", 2, B, 5.0, 1, [Claim(A, 1, 5.0)], {}, 0),
    ("equal since, we have the smaller id: we keep it", 2, A, 5.0, 1, [Claim(B, 1, 5.0)], {}, 1),
    ("a checkpoint's shard beyond num_shards is ignored", 2, A, 1.0, 7, [Claim(B, 0, 1.0)], {}, 1),
    ("more peers than shards: the least-shared shard", 2, C, 10.0, None,
     [Claim(A, 0, 1.0), Claim(B, 1, 1.0), Claim("peer-d", 1, 2.0)], {}, 0),
    ("more peers than shards, equally shared: the least-used", 2, C, 10.0, None,
     [Claim(A, 0, 1.0), Claim(B, 1, 1.0)], {0: 100, 1: 40}, 1),
])
def test_choose_shard(case, num_shards, me, since, preferred, others, usage, expected):
    chosen = choose_shard(num_shards, me, since, preferred, others, usage)
    assert 0 <= chosen < num_shards, case
    if expected is not None:
        assert chosen == expected, case
    assert chosen == choose_shard(num_shards, me, since, preferred, list(reversed(others)), dict(usage)), case


def test_newcomers_spread_over_the_free_shards_and_the_choice_is_stable():
    picks = [choose_shard(64, f"peer-{i}", 10.0, None, [], {}) for i in range(16)]
    assert len(set(picks)) >= 12  # a stable hash of (peer, shard): not all on shard 0
    assert picks == [choose_shard(64, f"peer-{i}", 10.0, None, [], {}) for i in range(16)]


def test_filling_a_swarm_one_peer_at_a_time_gives_disjoint_shards_then_shares_evenly():
    claims: list[Claim] = []
    for i in range(6):
        me = f"peer-{i}"
        claims.append(Claim(me, choose_shard(4, me, float(i), None, claims, {}), float(i)))
    shards = [c.shard for c in claims]
    assert sorted(shards[:4]) == [0, 1, 2, 3]  # disjoint while there are free shards
    assert sorted(shards).count(shards[4]) == 2 and shards[5] != shards[4]  # then two per shard at most
    assert sharing("peer-4", shards[4], claims) == 1 and sharing("peer-0", shards[0], claims) <= 1


def test_precedes_is_a_total_order():
    assert precedes(Claim(A, 0, 1.0), Claim(B, 0, 2.0)) and not precedes(Claim(B, 0, 2.0), Claim(A, 0, 1.0))
    assert precedes(Claim(A, 0, 1.0), Claim(B, 0, 1.0)) and not precedes(Claim(A, 0, 1.0), Claim(A, 0, 1.0))
