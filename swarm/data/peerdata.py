"""One peer's data: which shard it trains on (fixed, or leased through the swarm), and how far it has read each.

A trainer (swarm/train/trainer.py) holds a `PeerData` and asks it for every inner step's batch (`next_batch`). The
data position is the peer's own: samples drawn per shard, in the order its identity seeds (swarm/data/batches.py
TrainBatches). It moves only with the peer's own inner steps: taking the swarm's state moves the schedule,
never the data (the donor's data is the donor's). A checkpoint records it (`state()`: shard, identity, epoch,
offset, samples, the positions on the shards held before, the lease's since), and a resumed peer continues
from there (`restore` then `take`): the windows it reads after the restart are those the uninterrupted peer
would have read next.

The shard: with a lease (`leases`, swarm/net/leases.py) it is taken at start (`take`: the checkpoint's shard
if no live peer holds it first, else the least-used free one) and renewed at every round's start (`renew`);
without one it is the fixed shard the trainer was given, or the checkpoint's. Every rank of a multi-process
peer reads the same batches: rank 0 decides the shard and position and shares them (`Ranks.answer`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

import torch

from swarm.config import DataConfig
from swarm.data.batches import Corpus, TrainBatches, shard_index
from swarm.train.ranks import Ranks

log = logging.getLogger("swarm.data")


class Leases(Protocol):
    """What a peer's shard lease does (swarm/net/leases.py ShardLeases)."""

    since: float
    overlap_samples: int

    def acquire(self, preferred: Optional[int], since: Optional[float], positions: dict[int, int]) -> int: ...

    def renew(self, positions: dict[int, int]) -> int: ...


class PeerData:
    """The shard this peer trains on, its position on every shard it held, and the lease (None: a fixed shard)."""

    def __init__(self, corpus: Corpus, cfg: DataConfig, identity: str, shard: Optional[int], run_id: str,
                 ranks: Ranks, leases: Optional[Leases] = None):
        self.corpus, self.cfg, self.identity, self.ranks, self.leases = corpus, cfg, identity, ranks, leases
        self.leased = shard is None  # every rank agrees: rank 0 holds the lease, the others follow it
        self.initial = shard if shard is not None else shard_index(cfg, run_id, identity)
        self.positions: dict[int, int] = {}  # samples drawn per shard held before the current one
        self.batches: Optional[TrainBatches] = None
        self._resumed: dict[str, Any] = {}

    @property
    def shard(self) -> int:
        return self.batches.shard if self.batches is not None else self.initial

    def all_positions(self) -> dict[int, int]:
        here = {self.batches.shard: self.batches.position} if self.batches is not None else {}
        return {**self.positions, **here}

    def _use(self, shard: int) -> None:
        if self.batches is not None:
            if shard == self.batches.shard:
                return
            self.positions[self.batches.shard] = self.batches.position
        self.batches = TrainBatches(self.corpus, self.cfg, shard, self.identity, self.positions.pop(shard, 0))

    def restore(self, data: dict[str, Any], step: int) -> None:
        """The data position a checkpoint recorded (`state()`); a checkpoint of an older version records only
        (shard, epoch, step): its position was step * batch_size on that shard, in the order of (seed, shard)."""
        if "samples" in data:
            self.identity = data.get("identity", self.identity)
            self.positions = {int(k): v for k, v in data.get("positions", {}).items()}
            self.positions[data["shard"]] = data["samples"]
        elif "shard" in data:
            self.identity = ""
            self.positions = {data["shard"]: data.get("step", step) * self.cfg.batch_size}
        self.batches = None
        self._resumed = data

    def take(self) -> None:
        """Choose the shard to train on at start: the lease's (rank 0 asks, every rank follows), else the
        checkpoint's shard, else the one this peer was given."""
        preferred = self._resumed.get("shard", None if self.leased else self.initial)
        positions, since = self.all_positions(), self._resumed.get("since")

        def ask() -> tuple[int, str, dict[int, int]]:
            if self.leases is not None:
                return self.leases.acquire(preferred, since, positions), self.identity, positions
            return (self.initial if preferred is None else preferred), self.identity, positions

        shard, self.identity, self.positions = self.ranks.answer(ask)
        if self._resumed.get("shard", shard) != shard:
            log.info("resuming on data shard %d (the checkpoint's %d is held by another peer)", shard,
                     self._resumed["shard"])
        self._use(shard)

    def renew(self) -> None:
        """At a round's start: renew the lease (it may move this peer to another shard)."""
        if not self.leased:
            return
        positions = self.all_positions()
        self._use(self.ranks.answer(lambda: self.leases.renew(positions) if self.leases else self.batches.shard))

    def current(self) -> TrainBatches:
        """The shard read now (taken first if training has not started: `take`)."""
        if self.batches is None:
            self.take()
        return self.batches

    def next_batch(self) -> torch.Tensor:
        return self.current().next_batch()

    def state(self) -> dict[str, Any]:
        """What a checkpoint records of this peer's data (see the module's docstring)."""
        return {**self.current().state(), "positions": {str(k): v for k, v in self.positions.items()},
                "since": self.leases.since if self.leases is not None else None}

    def report(self) -> dict[str, Any]:
        """summary.json's `data` entry of this peer: its shard now, samples it drew and, of those, how many it
        trained while another live peer claimed the same shard (known with a lease only)."""
        drawn = sum(self.all_positions().values())
        overlap = self.leases.overlap_samples if self.leases is not None else 0
        return {"shard": self.shard, "identity": self.identity, "leased": self.leases is not None,
                "samples": drawn, "overlap_samples": overlap}
