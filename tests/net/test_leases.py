"""Data shards leased through the DHT (swarm/net/leases.py), in-process DHTs on loopback: disjoint leases while
peers join, die and restart; two newcomers racing for one shard; more peers than shards, counted as overlap."""

import concurrent.futures

import pytest
from hivemind.utils.timed_storage import get_dht_time

from swarm.config import live_window
from swarm.net.dht import start_dht
from swarm.net.identity import load_identity
from swarm.net.leases import ShardLeases
from swarm.run.configfile import load_config


class Clock:
    """DHT time plus an offset the test moves on: a peer that stops renewing is dead once it moved past the live
    window, without waiting for it."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return get_dht_time() + self.offset


class Swarm:
    """Peers (each its own DHT and key) that lease shards of one run; every DHT is shut down at the end."""

    def __init__(self, bootstrap: list[str], num_shards: int):
        self.cfg = load_config(None, {
            "swarm": {"run_id": "leases", "initial_peers": bootstrap, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
                      "request_timeout": 2.0, "matchmaking_time": 3.0, "bootstrap_timeout": 10.0},
            "data": {"num_shards": num_shards}})
        self.clock, self.dhts = Clock(), []

    def peer(self, name: str) -> ShardLeases:
        identity = load_identity(None)  # a fresh key: a restarted peer finds its lease by name
        dht = start_dht(self.cfg.swarm, identity)
        self.dhts.append(dht)
        return ShardLeases(self.cfg, dht, identity, name, clock=self.clock)

    def kill_time(self) -> None:
        """Move time past the live window: every peer that does not renew now is dead."""
        self.clock.offset += live_window(self.cfg.swarm) + 1.0

    def close(self) -> None:
        for dht in self.dhts:
            dht.shutdown()


@pytest.fixture
def swarm_of(bootstrap):
    made = []

    def make(num_shards: int) -> Swarm:
        made.append(Swarm(bootstrap, num_shards))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.mark.timeout(120)
def test_leases_stay_disjoint_while_peers_join_die_and_restart(swarm_of):
    swarm = swarm_of(4)
    a, b, c, d = (swarm.peer(n) for n in "abcd")
    shards = {p.name: p.acquire(None, None, {}) for p in (a, b, c, d)}
    assert sorted(shards.values()) == [0, 1, 2, 3]  # four newcomers, four shards: disjoint

    swarm.kill_time()  # b dies: the others renew, it does not
    assert [p.renew({p.shard: 64}) for p in (a, c, d)] == [shards["a"], shards["c"], shards["d"]]
    e = swarm.peer("e")
    assert e.acquire(None, None, {}) == shards["b"]  # the dead peer's lease expired: its shard is the free one

    b2 = swarm.peer("b")  # b restarts with a fresh key (same name): it takes its own shard back ...
    assert b2.acquire(None, None, {}) == shards["b"] and b2.since < e.since
    assert e.overlap_samples == 0
    swarm.kill_time()  # ... d dies meanwhile; at its next renewal e sees the earlier claim and moves to d's shard
    for p in (a, c, b2):
        p.renew({p.shard: 128})
    assert e.renew({shards["b"]: 32}) == shards["d"]
    assert e.overlap_samples == 32  # what e trained on b's shard while b was back: counted, not hidden
    live = [p.renew({p.shard: 160}) for p in (a, c, b2, e)]
    assert sorted(live) == [0, 1, 2, 3]


@pytest.mark.timeout(120)
def test_two_newcomers_racing_for_one_shard_end_on_two(swarm_of):
    swarm = swarm_of(3)
    first, second = swarm.peer("x"), swarm.peer("y")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both come with a checkpoint of shard 1
        got = list(pool.map(lambda p: p.acquire(1, None, {1: 8}), (first, second)))
    if got[0] == got[1]:  # both read before the other's store landed: the next renewal settles it
        got = [p.renew({p.shard: 16}) for p in (first, second)]
    assert got[0] != got[1] and 1 in got


@pytest.mark.timeout(120)
def test_more_peers_than_shards_share_the_least_shared_and_count_the_overlap(swarm_of):
    swarm = swarm_of(2)
    peers = [swarm.peer(f"p{i}") for i in range(3)]
    shards = [p.acquire(None, None, {}) for p in peers]
    assert sorted(shards[:2]) == [0, 1]  # disjoint while there are free shards, then shared
    third, shared_with = peers[2], peers[shards.index(shards[2])]
    for p in peers:
        p.renew({p.shard: 40})
    assert third.overlap_samples == 40 and shared_with.overlap_samples == 40
    assert peers[1 - shards.index(shards[2])].overlap_samples == 0
