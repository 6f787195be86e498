"""Which data shard a peer of a swarm trains on: the lease policy, as pure functions over the live leases.

In a swarm whose members change every round, each peer leases one of `data.num_shards` shards through the
DHT (swarm/net/leases.py stores and reads the signed records, `schema.LeaseRecord`). The rules:

- A shard's holder is the earliest of its live claimants by (since, peer id): `since` is when the claim began
  (a restarted peer keeps the `since` of its earlier lease, so it takes its own shard back; a newcomer that
  took the shard meanwhile sees an earlier claimant at its next renewal and moves).
- A peer keeps the shard it prefers (its own earlier lease, else its checkpoint's shard) unless another live
  peer holds it by those rules.
- Otherwise it takes the least-used free shard: no live claimant, then the fewest samples drawn from it by
  the peers that held it (their lease records say), then a stable hash of (peer, shard), so that newcomers
  starting together spread over the free shards instead of racing for one.
- With more live peers than shards there is no free shard: the peer takes the shard with the fewest live
  claimants (then the least used) and shares it. Its batch order is seeded by its own identity
  (swarm/data/batches.py TrainBatches), so the two peers never draw the same batch sequence, but they read the same
  windows in the same epoch: that duplicate training is counted (`overlap`) and reported as `data_overlap`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from swarm.data.batches import stable_hash


@dataclass(frozen=True)
class Claim:
    """A live lease of another peer (or ours): who, which shard, since when."""

    holder: str  # peer id of the lease's signer
    shard: int
    since: float  # DHT time when this claim on the shard began


def precedes(a: Claim, b: Claim) -> bool:
    """Whether claim `a` wins a shard over `b`: the earlier since, then the smaller peer id."""
    return (a.since, a.holder) < (b.since, b.holder)


def choose_shard(num_shards: int, me: str, since: float, preferred: Optional[int], others: Sequence[Claim],
                 usage: Mapping[int, int]) -> int:
    """The shard peer `me` should hold: `preferred` (claimed since `since`) if no live claim of `others` on it
    precedes ours, else the least-used free shard, else (more peers than shards) the least-shared one.
    `others`: the live claims of the other peers; `usage`: samples drawn so far from each shard by the peers
    whose lease records name it."""
    if preferred is not None and 0 <= preferred < num_shards:
        mine = Claim(me, preferred, since)
        if not any(c.shard == preferred and precedes(c, mine) for c in others):
            return preferred
    claimants = Counter(c.shard for c in others)
    return min(range(num_shards), key=lambda s: (claimants[s], usage.get(s, 0), stable_hash("lease", me, s)))


def sharing(me: str, shard: int, others: Sequence[Claim]) -> int:
    """How many other live peers claim `shard` (0: this peer trains on it alone)."""
    return sum(1 for c in others if c.shard == shard and c.holder != me)
