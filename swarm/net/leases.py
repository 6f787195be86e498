"""A peer's lease on a data shard, through the DHT: `ShardLeases.acquire()` at start, `renew()` at every outer step's
close. The policy (who takes which shard) is swarm/data/leases.py; the record is `schema.LeaseRecord` under
`{run_id}_leases`, signed by its owner like every record.

`acquire` reads the leases and progress records, chooses (shards.choose_shard), stores its lease and reads
again: two newcomers that chose one shard at the same moment see each other, and the later claim moves on
(at most `ACQUIRE_TRIES` times; a race still undecided then is settled at the next renewal). `renew` re-stores
the lease with the samples drawn so far, and moves to another shard when an earlier claimant holds this one (a
restarted peer taking its shard back). It also counts the samples this peer trained while another live peer
claimed the same shard (`overlap_samples`): duplicate training, reported as `data_overlap` in the summary.

Every DHT call waits at most `swarm.request_timeout` (renewals) or `swarm.bootstrap_timeout` (at start): a
read that does not answer keeps the shard this peer has (at start: the one it prefers, else a hash of its name),
with a warning, never a wait without end.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from swarm.config import Config, live_window
from swarm.data.leases import Claim, choose_shard, precedes, sharing
from swarm.net import policy, schema
from swarm.net.identity import Identity

log = logging.getLogger("swarm.data")
ACQUIRE_TRIES = 3


@dataclass
class Reading:
    """The run's leases as this peer reads them: the other peers' live claims, samples drawn per shard, and this
    peer's own earlier lease (by its key, or by its name from before it started: a restart with a fresh key)."""

    others: list[Claim]
    usage: dict[int, int]
    own: Optional[schema.LeaseRecord]


class ShardLeases:
    """This peer's lease (`shard`, None before `acquire`) and the samples it trained on a shared shard."""

    def __init__(self, cfg: Config, dht: hivemind.DHT, identity: Identity, name: str,
                 clock: Callable[[], float] = get_dht_time):
        """`clock`: DHT time (a test moves it on to let leases expire without waiting out the live window)."""
        self.cfg, self.dht, self.identity, self.name, self.clock = cfg, dht, identity, name, clock
        self.peer_id = identity.peer_id.to_base58()
        self.key = schema.leases_key(cfg.swarm.run_id)
        self.started = clock()
        self.shard: Optional[int] = None
        self.since = self.started
        self.overlap_samples = 0
        self._counted = 0  # samples already looked at for overlap
        self._lock = threading.Lock()  # one DHT exchange at a time from this object

    # ---- reading ---------------------------------------------------------------------------------------
    def _get(self, key: str, timeout: float):
        future = self.dht.get(key, latest=True, return_future=True)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def read(self, timeout: float) -> Reading:
        """The leases now (concurrent.futures.TimeoutError if the DHT does not answer within `timeout`)."""
        s = self.cfg.swarm
        found = self._get(self.key, timeout)
        progress = self._get(schema.progress_key(s.run_id), timeout)
        now = self.clock()
        leases = schema.read_owned(found, schema.LeaseRecord, now, s.identity_work)
        beating = schema.read_owned(progress, schema.ProgressRecord, now, s.identity_work, s.progress_expiration)
        window = live_window(s)
        others, usage, own = [], {}, leases.get(self.peer_id)
        for holder, lease in leases.items():
            if holder == self.peer_id:
                continue
            if lease.name == self.name and lease.time < self.started:  # our earlier self, with another key
                if own is None or lease.time > own.time:
                    own = lease
                continue
            usage[lease.shard] = usage.get(lease.shard, 0) + lease.samples
            if now - lease.time <= window or (holder in beating and policy.is_live(beating[holder], now, window)):
                others.append(Claim(holder, lease.shard, lease.since))
        return Reading(others, usage, own)

    def _store(self, samples: int, timeout: float) -> None:
        now = self.clock()
        record = schema.LeaseRecord(name=self.name, shard=self.shard, since=float(self.since), samples=samples,
                                    time=float(now), work=self.identity.work)
        future = self.dht.store(self.key, record.dict(), subkey=self.identity.owner,
                                expiration_time=now + schema.RUN_RECORD_EXPIRATION, return_future=True)
        try:
            future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            log.warning("the lease on data shard %d was not confirmed within %g s", self.shard, timeout)

    # ---- the lease ---------------------------------------------------------------------------------------
    def acquire(self, preferred: Optional[int], since: Optional[float], positions: dict[int, int]) -> int:
        """Take a shard: `preferred` (the checkpoint's, claimed since `since`) unless this peer's own earlier lease
        in the DHT says otherwise or a live peer holds it first. `positions`: samples drawn per shard by this
        peer so far (its checkpoint's), stored with the lease."""
        timeout = self.cfg.swarm.bootstrap_timeout
        with self._lock:
            for _ in range(ACQUIRE_TRIES):
                try:
                    reading = self.read(timeout)
                except concurrent.futures.TimeoutError:
                    return self._fallback(preferred, f"the leases did not answer within {timeout:g} s")
                if reading.own is not None and self.shard is None:
                    preferred, since = reading.own.shard, reading.own.since  # ours from before the restart
                keep = preferred if self.shard is None else self.shard
                chosen = choose_shard(self.cfg.data.num_shards, self.peer_id, since or self.since, keep,
                                      reading.others, reading.usage)
                if chosen != keep or since is None:
                    since = self.clock()  # a new claim on this shard
                self.shard, self.since = chosen, since
                self._store(positions.get(chosen, 0), timeout)
                try:
                    reading = self.read(timeout)
                except concurrent.futures.TimeoutError:
                    break
                mine = Claim(self.peer_id, chosen, self.since)
                if not any(c.shard == chosen and precedes(c, mine) for c in reading.others):
                    break
            self._counted = positions.get(self.shard, 0)
            self._announce(reading)
            return self.shard

    def _fallback(self, preferred: Optional[int], why: str) -> int:
        from swarm.data.batches import shard_index

        self.shard = preferred if preferred is not None else shard_index(self.cfg.data, self.cfg.swarm.run_id,
                                                                         self.name)
        log.warning("%s: training on data shard %d unleased", why, self.shard)
        return self.shard

    def _announce(self, reading: Reading) -> None:
        shared = sharing(self.peer_id, self.shard, reading.others)
        if shared:
            log.warning("data shard %d is shared with %d other live peer(s) (%d live peers, data.num_shards %d): "
                        "their batch orders differ, their data does not", self.shard, shared,
                        len(reading.others) + 1, self.cfg.data.num_shards)
        else:
            log.info("leased data shard %d of %d", self.shard, self.cfg.data.num_shards)

    def renew(self, positions: dict[int, int]) -> int:
        """At an outer step's close, with `positions` the samples this peer has drawn per shard: count the samples
        trained since the last renewal as overlapped if another live peer claims the current shard, re-store the
        lease, and move to another shard if an earlier claimant holds this one. Returns the shard to train on."""
        timeout = self.cfg.swarm.request_timeout
        with self._lock:
            try:
                reading = self.read(timeout)
            except concurrent.futures.TimeoutError:
                log.warning("the leases did not answer within %g s: keeping data shard %d", timeout, self.shard)
                return self.shard
            samples = positions.get(self.shard, 0)
            if sharing(self.peer_id, self.shard, reading.others):
                self.overlap_samples += max(0, samples - self._counted)
            chosen = choose_shard(self.cfg.data.num_shards, self.peer_id, self.since, self.shard, reading.others,
                                  reading.usage)
            if chosen != self.shard:
                log.info("data shard %d is held by an earlier claimant: moving to shard %d", self.shard, chosen)
                self.shard, self.since = chosen, self.clock()
            self._counted = positions.get(self.shard, 0)
            self._store(self._counted, timeout)
            return self.shard
