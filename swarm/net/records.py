"""`SwarmAverager`'s DHT records (its `records` attribute): its progress record (heartbeat included) and where
it stands by the records of others (`policy.assess`).

- `publish_progress()`: a `ProgressRecord` under `{run_id}_progress`, signed (with the trainer's last
  `PeerStats`, for watchers); a heartbeat thread re-stores it every `cfg.progress_interval`, so a record
  that stopped changing is a dead peer's (policy.py).
- `offer_state()`: the commit record of a snapshot, then serving it, done by the heartbeat as well.
- `peers()`, `assess()`: the run's records as their signers wrote them, and the policy's verdict on them (with
  nobody else live, by the last commits of the keys `ledger` knows: ledger.py); peers whose claims the policy
  ignored are noted in this peer's events (access.py).
- `round_over()`: whether most live groupmates finished their inner steps or the swarm moved past us (the
  trainer asks after every inner step; the DHT is read at most once per `progress_interval`).
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

from swarm.config import SwarmConfig, live_window
from swarm.net import policy, schema
from swarm.net.access import Access
from swarm.net.certificates import Anchor
from swarm.net.hostile import Hooks
from swarm.net.ledger import Ledger
from swarm.net.statesync import StateServer
from swarm.train.averaging import PeerStats, Snapshot

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where the trainer last said it stands (`publish_progress`): what every progress record we store carries."""

    outer_step: int
    inner_step: int
    samples: int
    samples_per_s: float
    ready: bool
    sha256: str


class Records:
    """A peer's own progress and commit records, stored by a heartbeat thread (`start()` ... `close()`), and
    its reading of everyone's records, with the keys `ledger` knows (ledger.py). `server` is the peer's state
    server: a state is served (`serving`) once its commit record is stored."""

    def __init__(self, cfg: SwarmConfig, dht: hivemind.DHT, peer_id: str, peer_name: str, owner: bytes,
                 access: Access, hooks: Hooks, server: StateServer, work: int = 0, ledger: Optional[Ledger] = None):
        self.cfg, self.dht, self.peer_id, self.peer_name = cfg, dht, peer_id, peer_name
        self.access, self.hooks, self.server = access, hooks, server
        self.ledger = ledger or Ledger()
        self._owner = owner  # our owner marker: the subkey of every record we write (we sign them)
        self._work = work  # the nonce of our proof of work (swarm.identity_work), in every record we write
        self._stats = PeerStats()  # the last ones the trainer gave, in every record until it gives others
        self._last_progress: Optional[Progress] = None  # re-sent by the heartbeat
        self._published: Optional[schema.ProgressRecord] = None  # our last record, as we made it
        self._seen: dict[str, schema.ProgressRecord] = {}  # the newest record of each peer read, while live
        self._ready_seen: tuple[int, float, bool] = (-1, 0.0, False)  # round_over: (outer step, when, answer)
        self._dht_lock = threading.Lock()  # the trainer's thread and the heartbeat share the DHT's pipe
        self._stopping = threading.Event()
        self._progress_due = threading.Event()  # the trainer published a record: the heartbeat stores it now
        self._committed = ""  # the state's hash (swarm/state/statehash.py) of our last commit (offer_state)
        self._commit_lock = threading.Lock()
        self._signing: Optional[schema.Statement] = None  # our statement of the commit under way (`sign`)
        self._offered: Optional[Snapshot] = None  # the state offer_state was last given (None: withdrawn)
        self._pending_commit: Optional[Snapshot] = None  # offered, its commit record not stored yet
        self._storing: set[concurrent.futures.Future] = set()  # stores not answered yet, not waited for
        self._beat = threading.Thread(target=self._heartbeat, name="swarm-heartbeat", daemon=True)

    def start(self) -> None:
        """Start the heartbeat."""
        self._beat.start()

    def close(self) -> None:
        """Stop the heartbeat, then store a commit record still pending: others take their bearings from it."""
        self._stopping.set()
        self._progress_due.set()  # wakes the heartbeat, which sees _stopping
        if self._beat.is_alive():
            self._beat.join(self.cfg.request_timeout + self.cfg.progress_interval)
        self.flush_commit()

    @property
    def committed(self) -> str:
        """The state's hash of our last commit ("" before the first)."""
        return self._committed

    @property
    def serving(self) -> Optional[Snapshot]:
        """The state we serve to newcomers (None: nothing yet, withdrawn, or a client)."""
        return self.server.snapshot

    @property
    def commit_pending(self) -> bool:
        """A state was offered and its commit record is not stored yet (the heartbeat stores it)."""
        return self._pending_commit is not None

    @property
    def unconfirmed(self) -> int:
        """Stores sent without waiting that the DHT has not answered yet."""
        return len(self._storing)

    def announced_ready(self, outer_step: int) -> bool:
        """Whether our last published record says we are ready for `outer_step`."""
        last = self._last_progress
        return last is not None and last.outer_step == outer_step and last.ready

    def publish_progress(self, outer_step: int, inner_step: int, samples: int, samples_per_s: float,
                         ready: bool = False, sha256: str = "", stats: Optional[PeerStats] = None,
                         wait: bool = False) -> None:
        """Returns at once: the heartbeat thread stores the record. The trainer calls this from inside its
        inner steps, and a store waits for a DHT round trip, which the inner steps must not wait for on a slow
        link (bench/utilization.py measures what is left). `wait`: store it on this
        thread, returning once the DHT confirmed it (or after request_timeout), for announcements that
        others must see before this peer goes on (taking a state, finished)."""
        self._stats = stats or self._stats
        self._last_progress = Progress(outer_step, inner_step, samples, samples_per_s, ready, sha256)
        if wait:
            self._store_progress(wait=True)
        else:
            self._progress_due.set()

    def _store_progress(self, wait: bool) -> None:
        with self._dht_lock:  # read, stamp and send in one go: a later store always carries later content
            last, now = self._last_progress, get_dht_time()
            record = schema.ProgressRecord(
                peer_id=self.peer_id, name=self.peer_name, round=last.outer_step, inner_step=last.inner_step,
                samples=last.samples, samples_per_s=float(last.samples_per_s), time=float(now),
                serves_state=self.server.snapshot is not None, ready=last.ready, sha256=last.sha256, work=self._work,
                statement=self._statement(last.outer_step, last.sha256),
                **schema.watched(**dataclasses.asdict(self._stats)))
            self._published = record
            future = self.dht.store(schema.progress_key(self.cfg.run_id), self.hooks.progress(record.dict()),
                                    subkey=self._owner,
                                    expiration_time=now + self.cfg.progress_expiration, return_future=True)
        # Stores not waited for overlap: a DHT node keeps the record that expires last and refuses an older one
        # that arrives after it, which is no loss once a later record of ours was sent.
        self._confirm(future, f"progress record of outer step {last.outer_step}", wait,
                      superseded=lambda: self._published is not record)

    def _statement(self, outer_step: int, sha256: str) -> Optional[schema.Statement]:
        """Our statement backing a record at (outer_step, sha256): that of the commit, if we signed it."""
        statements = self.ledger.statements
        last = statements[-1] if statements else None
        return last if last is not None and (last.outer_step, last.sha256) == (outer_step, sha256) else None

    def _confirm(self, future: concurrent.futures.Future, what: str, wait: bool,
                 then: Optional[Callable[[], None]] = None, superseded: Callable[[], bool] = lambda: False) -> None:
        """Warn if the DHT did not take `what` (unless refused as `superseded` by a later store of ours), then
        run `then`: here, waiting at most request_timeout, with `wait`; else when the DHT answers. The
        heartbeat never waits: while an outer step's all-reduce filled a slow link a store took seconds, and a ready
        record queued behind it let a faster peer's group close before the stragglers that it should have cut
        short arrived (an outer step split in two groups)."""
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

    def sign(self, outer_step: int, parent: str, group: bytes, size: int) -> None:
        """We are about to commit `outer_step` from the global parameters `parent`, in `group` of `size` members
        (alone: b"", 1): our statement of it (schema.Statement) goes out with the commit, once its hash is
        known (`offer_state`); a commit of another outer step, or a state taken meanwhile, drops it."""
        self._signing = schema.Statement(round=outer_step, parent=parent, sha256="0" * 64, group=group.hex(),
                                         size=size) if parent else None

    def offer_state(self, snapshot: Snapshot, wait: bool = False) -> None:
        """Record the commit, then serve `snapshot`: a newcomer checks what it downloads against the commit
        records. Returns at once, like publish_progress, unless `wait`: the heartbeat thread does both, so the
        trainer never waits for the DHT here. Our lineage and our
        statement of the commit (`sign`) go to the ledger, for our records and our readings of others'. Our
        progress record moves to the committed outer step (not ready) at once: until the trainer's next record,
        the heartbeat would re-store one ready for the outer step just committed, and a peer still there (one
        that finished taking a state meanwhile) would take us for groupmates waiting to average it."""
        signing, self._signing = self._signing, None
        statement = None
        if signing is not None and signing.outer_step == snapshot.outer_step:
            statement = signing.copy(update={"sha256": snapshot.sha256})
        self.ledger.hold(snapshot.outer_step, snapshot.sha256, statement)
        self._committed = snapshot.sha256
        last = self._last_progress
        if last is not None:  # our progress record moves with the commit, stored right after its commit record
            self._last_progress = dataclasses.replace(last, outer_step=snapshot.outer_step, sha256=snapshot.sha256,
                                                      ready=False)
        with self._commit_lock:
            self._offered = snapshot
            if not wait:
                self._pending_commit = snapshot
                self._progress_due.set()
                return
        self._store_commit(snapshot)
        self._progress_due.set()

    def withdraw_state(self) -> None:
        """Serve nothing from now on (our state is about to be overwritten), not even an offer still pending."""
        with self._commit_lock:
            self._offered = self._pending_commit = None
            self.server.snapshot = None
        self._signing = None

    def flush_commit(self, wait: bool = True) -> None:
        """Store the commit record still pending, if any: before our last progress record, or leaving."""
        with self._commit_lock:
            snapshot, self._pending_commit = self._pending_commit, None
        if snapshot is not None:
            self._store_commit(snapshot, wait)

    def _store_commit(self, snapshot: Snapshot, wait: bool = True) -> None:
        now = get_dht_time()
        record = schema.CommitRecord(name=self.peer_name, round=snapshot.outer_step, sha256=snapshot.sha256, time=now,
                                     work=self._work, statements=list(self.ledger.statements))
        with self._dht_lock:
            future = self.dht.store(schema.commits_key(self.cfg.run_id), self.hooks.commit(record.dict()),
                                    subkey=self._owner,
                                    expiration_time=now + schema.RUN_RECORD_EXPIRATION, return_future=True)

        def serve() -> None:  # unless withdrawn or superseded meanwhile; a client cannot be dialed: never serves
            with self._commit_lock:
                if self._offered is snapshot and not self.cfg.client_mode:
                    self.server.snapshot = snapshot
        self._confirm(future, f"commit record of outer step {snapshot.outer_step}", wait, then=serve)

    def _heartbeat(self) -> None:
        """Store our record when the trainer published a new one, and re-store it every progress_interval
        whatever the trainer does (eval, a checkpoint, a long all-reduce): a live peer's record stays fresh,
        so one older than the live window is a dead peer's."""
        while True:
            self._progress_due.wait(self.cfg.progress_interval)
            if self._stopping.is_set():
                return
            self._progress_due.clear()
            self.flush_commit(wait=False)
            if self._last_progress is not None:
                self._store_progress(wait=False)

    def read(self, key: str, model: type) -> Optional[dict[str, object]]:
        """This run's records under `key` by their signers' peer ids (schema.read_owned: bounded, and with
        `swarm.identity_work` only those of proven identities); None if the DHT did not answer within the
        live window (a failed read must not look like an empty swarm; what a slower read returns would be
        stale anyway: a live peer's record may have aged out of the window meanwhile)."""
        with self._dht_lock:
            future = self.dht.get(key, latest=True, return_future=True)
        try:
            found = future.result(timeout=live_window(self.cfg))
        except concurrent.futures.TimeoutError:
            future.cancel()
            logger.warning(f"reading {key} did not answer within {live_window(self.cfg):g} s (the live window)")
            return None
        lifetime = self.cfg.progress_expiration if model is schema.ProgressRecord else schema.RUN_RECORD_EXPIRATION
        return schema.read_owned(found, model, get_dht_time(), self.cfg.identity_work, lifetime)

    def peers(self) -> list[schema.ProgressRecord]:
        """Progress records of this run (ours included, as we made it), each signed by the peer it describes;
        [] if the read failed (`read_peers` tells that apart). With `swarm.identity_work`, the peers they name
        are the proven ones (access)."""
        return self.read_peers() or []

    def read_peers(self) -> Optional[list[schema.ProgressRecord]]:
        """`peers()`, or None if the read failed. A live peer's record that a read misses (the DHT node that
        answered lacks it: a store that did not reach every replica) is taken from an earlier read, as long as
        it is within the live window: a record that vanishes before its window ends is a failed read, not a
        departure (else the peers that remain look alone, and a peer that averaged once commits its own
        pseudo-gradient alone beside them)."""
        records = self.read(schema.progress_key(self.cfg.run_id), schema.ProgressRecord)
        if records is None:
            return None
        now, window = get_dht_time(), live_window(self.cfg)
        for peer, record in self._seen.items():
            if now - record.time <= window and (peer not in records or records[peer].time < record.time):
                records[peer] = record
        self._seen = {peer: record for peer, record in records.items() if now - record.time <= window}
        if self.cfg.identity_work:
            self.access.prove({*records, self.peer_id})
        if self.peer_id in records and self._published is not None:
            records[self.peer_id] = self._published
        return list(records.values())

    def assess(self, outer_step: int, sha256: str, commits: bool = True) -> policy.Position:
        """Where we stand at `outer_step` with state hash `sha256` by the records (policy.assess); without
        `commits`, the commit records are not read (`round_over` needs only the progress records). A read
        that failed makes it UNSURE."""
        records = self.read(schema.commits_key(self.cfg.run_id), schema.CommitRecord) if commits else {}
        if records is None:
            return policy.Position(policy.Verdict.UNSURE, outer_step, None, None, note="commit records unreadable")
        peers = self.peers()
        if outer_step == 0:  # the run's founders: live at outer step 0 with us (ledger.found)
            self.ledger.found(r.peer_id for r in peers if r.outer_step == 0
                              and policy.is_live(r, get_dht_time(), live_window(self.cfg)))
        position = policy.assess(self.peer_id, outer_step, sha256, peers, records, get_dht_time(),
                                 live_window(self.cfg), self.ledger.known, self.anchor() if commits else None)
        for peer in position.ignored:
            self.access.note("ignored_claim", peer, "claims an outer step more than one past the swarm's majority")
        self.ledger.remember(dict(position.credit))
        for peer in position.uncertified:
            self.access.note("uncertified_claim", peer, f"claims an outer step past {outer_step} on a hash no group "
                                                        f"certified (certificates.py): not counted")
        return position

    def anchor(self) -> Anchor:
        """What we ground certificates on (certificates.py): the hashes we held, the run's founders (ledger.py)."""
        return Anchor(self.ledger.lineage, self.ledger.founders, self.ledger.credit, self.ledger.steps)

    def round_over(self, outer_step: int) -> bool:
        """Whether the trainer's round at `outer_step` should end now (`Averager.round_over`): most live groupmates
        finished their inner steps, or the swarm committed past `outer_step`. Asked after every inner step; reads
        the DHT at most once per `progress_interval` (a fresh answer is no fresher than the records it reads)."""
        seen, asked, answer = self._ready_seen
        if seen == outer_step and time.monotonic() - asked < self.cfg.progress_interval:
            return answer
        # our last record's hash only if it is the hash at `outer_step` (not before our first record): another hash
        # claimed at `outer_step` would make every groupmate's true record of it a lie
        last = self._last_progress
        sha = last.sha256 if last is not None and last.outer_step == outer_step else ""
        position = self.assess(outer_step, sha, commits=False)
        answer = position.others_ready
        if position.verdict is policy.Verdict.BEHIND:  # one identity one vote so far: only certificates settle it
            answer = self.assess(outer_step, sha).verdict is policy.Verdict.BEHIND
        self._ready_seen = (outer_step, time.monotonic(), answer)
        return answer
