"""`SwarmAverager`'s DHT records: its progress record (heartbeat included) and where it stands by the records
of others (`policy.assess`).

- `publish_progress()`: a `ProgressRecord` under `{run_id}_progress`, signed (with the trainer's last
  `PeerStats`, for watchers); a heartbeat thread re-stores it every `cfg.progress_interval`, so a record
  that stopped changing is a dead peer's (policy.py).
- `peers()`, `_assess()`: the run's records as their signers wrote them, and the policy's verdict on them;
  peers whose claims the policy ignored are noted in this peer's events (access.py).
- `others_ready()`: whether most live groupmates finished their inner steps (the trainer asks after every
  inner step; the DHT is read at most once per `progress_interval`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Optional

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from swarm.averaging import PeerStats
from swarm.config import SwarmConfig, live_window
from swarm.net import policy, schema
from swarm.net.access import Access
from swarm.net.hostile import Hooks
from swarm.net.statesync import StateServer

logger = logging.getLogger(__name__)


class Records:
    cfg: SwarmConfig
    dht: hivemind.DHT
    peer_id: str
    peer_name: str
    access: Access
    hooks: Hooks
    _owner: bytes  # our owner marker: the subkey of every record we write (we sign them)
    _stats: PeerStats
    _last_progress: Optional[tuple]
    _published: Optional[schema.ProgressRecord]
    _ready_seen: tuple[int, float, bool]
    _dht_lock: threading.Lock
    _stopping: threading.Event
    _server: StateServer  # we serve a state once we committed one (`serves_state` in our record)

    def publish_progress(self, round: int, inner_step: int, samples: int, samples_per_s: float,
                         ready: bool = False, sha256: str = "", stats: Optional[PeerStats] = None) -> None:
        self._stats = stats or self._stats
        self._last_progress = (round, inner_step, samples, samples_per_s, ready, sha256)
        self._store_progress(warn=True)

    def _store_progress(self, warn: bool) -> None:
        with self._dht_lock:  # read, stamp and send in one go: a later store always carries later content
            round, inner_step, samples, samples_per_s, ready, sha256 = self._last_progress
            now = get_dht_time()
            record = schema.ProgressRecord(
                peer_id=self.peer_id, name=self.peer_name, round=round, inner_step=inner_step, samples=samples,
                samples_per_s=float(samples_per_s), time=float(now), serves_state=self._server.snapshot is not None,
                ready=ready, sha256=sha256, **schema.watched(**dataclasses.asdict(self._stats)))
            self._published = record
            future = self.dht.store(schema.progress_key(self.cfg.run_id), self.hooks.progress(record.dict()),
                                    subkey=self._owner,
                                    expiration_time=now + self.cfg.progress_expiration, return_future=True)
        try:
            if not future.result(timeout=self.cfg.request_timeout) and warn:
                logger.warning("progress record was not stored (no DHT peer accepted it)")
        except concurrent.futures.TimeoutError:
            if warn:
                logger.warning(f"progress record not confirmed within {self.cfg.request_timeout:g} s")

    def _heartbeat(self) -> None:
        """Re-store our record every progress_interval whatever the trainer does (eval, a checkpoint, a long
        all-reduce): a live peer's record stays fresh, so one older than the live window is a dead peer's."""
        while not self._stopping.wait(self.cfg.progress_interval):
            if self._last_progress is not None:
                self._store_progress(warn=False)

    def _read(self, key: str, model: type) -> dict[str, object]:
        """This run's records under `key` by their signers' peer ids (schema.read_owned)."""
        with self._dht_lock:
            future = self.dht.get(key, latest=True, return_future=True)
        return schema.read_owned(future.result(), model, get_dht_time())

    def peers(self) -> list[schema.ProgressRecord]:
        """Progress records of this run (ours included, as we made it), each signed by the peer it describes."""
        records = self._read(schema.progress_key(self.cfg.run_id), schema.ProgressRecord)
        if self.peer_id in records and self._published is not None:
            records[self.peer_id] = self._published
        return list(records.values())

    def _assess(self, round: int, sha256: str, commits: bool = True) -> policy.Position:
        records = self._read(schema.commits_key(self.cfg.run_id), schema.CommitRecord) if commits else {}
        position = policy.assess(self.peer_id, round, sha256, self.peers(), records, get_dht_time(),
                                 live_window(self.cfg))
        for peer in position.ignored:
            self.access.note("ignored_claim", peer, "claims a round more than one past the swarm's majority")
        return position

    def others_ready(self, round: int) -> bool:
        """Asked after every inner step; reads the DHT at most once per `progress_interval` (a fresh answer
        is no fresher than the progress records it reads)."""
        seen_round, asked, answer = self._ready_seen
        if seen_round == round and time.monotonic() - asked < self.cfg.progress_interval:
            return answer
        sha = self._last_progress[5] if self._last_progress else ""
        answer = self._assess(round, sha, commits=False).others_ready
        self._ready_seen = (round, time.monotonic(), answer)
        return answer
