"""`SwarmAverager`'s DHT records: its progress record (heartbeat included) and where it stands by the records
of others (`policy.assess`).

- `publish_progress()`: a `ProgressRecord` under `{run_id}_progress`, signed (with the trainer's last
  `PeerStats`, for watchers); a heartbeat thread re-stores it every `cfg.progress_interval`, so a record
  that stopped changing is a dead peer's (policy.py).
- `offer_state()`: the commit record of a snapshot, then serving it, done by the heartbeat as well.
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
from typing import Callable, Optional

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from swarm.averaging import PeerStats, Snapshot
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
    _progress_due: threading.Event  # the trainer published a record: the heartbeat stores it now
    _server: StateServer  # we serve a state once we committed one (`serves_state` in our record)
    _committed: str
    _commit_lock: threading.Lock
    _offered: Optional[Snapshot]
    _pending_commit: Optional[Snapshot]
    _storing: set[concurrent.futures.Future]  # stores not answered yet, that the heartbeat did not wait for

    def publish_progress(self, round: int, inner_step: int, samples: int, samples_per_s: float,
                         ready: bool = False, sha256: str = "", stats: Optional[PeerStats] = None,
                         wait: bool = False) -> None:
        """Returns at once: the heartbeat thread stores the record. The trainer calls this from inside its
        inner steps, and a store waits for a DHT round trip: waiting for it there cost ~8% of the inner
        steps' time on 20 Mbit/s links (py-spy of bench/utilization.py's peers). `wait`: store it on this
        thread, returning once the DHT confirmed it (or after request_timeout), for announcements that
        others must see before this peer goes on (taking a state, finished)."""
        self._stats = stats or self._stats
        self._last_progress = (round, inner_step, samples, samples_per_s, ready, sha256)
        if wait:
            self._store_progress(wait=True)
        else:
            self._progress_due.set()

    def _store_progress(self, wait: bool) -> None:
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
        # Stores not waited for overlap: a DHT node keeps the record that expires last and refuses an older one
        # that arrives after it, which is no loss once a later record of ours was sent.
        self._confirm(future, f"progress record of round {round}", wait,
                      superseded=lambda: self._published is not record)

    def _confirm(self, future: concurrent.futures.Future, what: str, wait: bool,
                 then: Optional[Callable[[], None]] = None, superseded: Callable[[], bool] = lambda: False) -> None:
        """Warn if the DHT did not take `what` (unless refused as `superseded` by a later store of ours), then
        run `then`: here, waiting at most request_timeout, with `wait`; else when the DHT answers. The
        heartbeat never waits: while a round's all-reduce filled a slow link a store took seconds, and a ready
        record queued behind it let a faster peer's group close before the stragglers that it should have cut
        short arrived (a round split in two groups)."""
        def confirmed(done: concurrent.futures.Future) -> None:
            self._storing.discard(done)
            if not done.cancelled() and not self._stopping.is_set():  # stopping: the DHT may be gone first
                refused = done.exception() is None and not done.result()
                if done.exception() is not None or (refused and not superseded()):
                    logger.warning(f"{what} was not stored: {done.exception() or 'no DHT peer accepted it'}")
            if then is not None:
                then()
        if not wait:
            self._storing.add(future)  # hivemind drops the answer to a future nobody holds, callbacks and all
            future.add_done_callback(confirmed)
        elif concurrent.futures.wait([future], timeout=self.cfg.request_timeout).done:
            confirmed(future)
        else:
            logger.warning(f"{what} not confirmed within {self.cfg.request_timeout:g} s")
            if then is not None:
                then()

    def offer_state(self, snapshot: Snapshot, wait: bool = False) -> None:
        """Record the commit, then serve `snapshot`: a newcomer checks what it downloads against the commit
        records. Returns at once, like publish_progress, unless `wait`: the heartbeat thread does both (the
        trainer waiting for the DHT here cost ~2% of a 10-step round on 20 Mbit/s links)."""
        self._committed = snapshot.sha256
        with self._commit_lock:
            self._offered = snapshot
            if not wait:
                self._pending_commit = snapshot
                self._progress_due.set()
                return
        self._store_commit(snapshot)

    def _withdraw_state(self) -> None:
        """Serve nothing from now on (our state is about to be overwritten), not even an offer still pending."""
        with self._commit_lock:
            self._offered = self._pending_commit = None
            self._server.snapshot = None

    def _flush_commit(self, wait: bool = True) -> None:
        """Store the commit record still pending, if any: before our last progress record, or leaving."""
        with self._commit_lock:
            snapshot, self._pending_commit = self._pending_commit, None
        if snapshot is not None:
            self._store_commit(snapshot, wait)

    def _store_commit(self, snapshot: Snapshot, wait: bool = True) -> None:
        now = get_dht_time()
        record = schema.CommitRecord(name=self.peer_name, round=snapshot.round, sha256=snapshot.sha256, time=now)
        with self._dht_lock:
            future = self.dht.store(schema.commits_key(self.cfg.run_id), record.dict(), subkey=self._owner,
                                    expiration_time=now + schema.RUN_RECORD_EXPIRATION, return_future=True)

        def serve() -> None:  # unless withdrawn or superseded meanwhile; a client cannot be dialed: never serves
            with self._commit_lock:
                if self._offered is snapshot and not self.cfg.client_mode:
                    self._server.snapshot = snapshot
        self._confirm(future, f"commit record of round {snapshot.round}", wait, then=serve)

    def _heartbeat(self) -> None:
        """Store our record when the trainer published a new one, and re-store it every progress_interval
        whatever the trainer does (eval, a checkpoint, a long all-reduce): a live peer's record stays fresh,
        so one older than the live window is a dead peer's."""
        while True:
            self._progress_due.wait(self.cfg.progress_interval)
            if self._stopping.is_set():
                return
            self._progress_due.clear()
            self._flush_commit(wait=False)
            if self._last_progress is not None:
                self._store_progress(wait=False)

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
