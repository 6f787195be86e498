"""What the monitor knows about a run: typed records read from the DHT, folded into a bounded view.

`read_swarm` is the only code that reads the DHT (so a change in how records are stored or signed is
adapted here alone). `SwarmView.update` folds each reading into a table of peers, the eval loss per round
and a list of events:

- join: a peer's record is live (`policy.is_live` within `config.live_window`) and was not before;
- leave: a peer's last record stopped being refreshed (its heartbeat stopped: it finished, crashed or was
  killed). A peer missing from one reading is not gone: a DHT read that times out looks like an empty
  swarm, so only the age of its last record counts;
- commit: the highest round any peer committed (`{run}_commits`) went up;
- refused: a record under the run's keys that does not fit the schema or claims another peer's id;
- whatever the caller adds (`swarm local` adds its kills and joins).

Every record comes from the network, so everything kept is bounded: MAX_PEERS rows (the stalest are
dropped first), MAX_ROUNDS rounds of eval loss with at most MAX_EVAL_PEERS peers each, MAX_EVENTS events.

`history()` is what outlives the monitor (the eval loss per round, the events, the highest commit seen) and
`restore()` takes it back, bounded the same way: `swarm monitor` keeps it in a file across restarts, so its
chart covers the run, not only the time since it started. The peer table is not kept: it is read anew.
"""

from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass, field
from typing import Optional

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from swarm.net import policy, schema
from swarm.net.identity import owner_peer_id
from swarm.net.policy import run_fingerprint
from swarm.net.schema import CommitRecord, ProgressRecord

MAX_PEERS = 256  # rows in the peer table and commit records kept; a stranger may publish many records
MAX_ROUNDS = 1000  # rounds of eval loss kept for the chart (the latest)
MAX_EVAL_PEERS = 64  # peers averaged into one round's eval loss
MAX_EVENTS = 500  # events kept (the latest)
MAX_REFUSED = 16  # refused records reported per reading
MAX_TEXT = 64  # characters of a name or subkey shown
HISTORY_VERSION = 1  # the layout of `SwarmView.history()`


def short(text: object) -> str:
    text = str(text)
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


@dataclass
class Reading:
    """One read of a run's records."""

    progress: dict[str, ProgressRecord] = field(default_factory=dict)  # peer id -> its record
    commits: dict[str, CommitRecord] = field(default_factory=dict)  # peer id -> its last commit
    refused: list[tuple[str, str]] = field(default_factory=list)  # (subkey, why) of records we cannot use
    fingerprint: Optional[str] = None  # the run's fingerprint (`{run}_run`), None if not stored
    time: float = 0.0  # DHT time of the read


def _get(dht: hivemind.DHT, key: str, timeout: float):
    """Raises TimeoutError past `timeout`: a failed read must not look like an empty swarm."""
    return dht.get(key, latest=True, return_future=True).result(timeout=timeout)


def _records(found, model: type, now: float, reading: Reading) -> dict:
    records = {}
    if found is None or not isinstance(found.value, dict):
        return records
    for subkey, item in found.value.items():
        if item.expiration_time <= now:
            continue
        owner = owner_peer_id(subkey)
        record = schema.parse(model, item.value)
        if owner is None:
            reason = "not owned by a peer key"
        elif record is None:
            reason = "does not fit the schema"
        elif getattr(record, "peer_id", owner) != owner:
            reason = f"claims peer id {short(record.peer_id)}"
        else:
            records[owner] = record
            continue
        if len(reading.refused) < MAX_REFUSED:
            reading.refused.append((short(owner or subkey), f"{model.__name__}: {reason}"))
    return records


def read_swarm(dht: hivemind.DHT, run_id: str, timeout: float) -> Reading:
    """The run's progress and commit records and its fingerprint, typed; TimeoutError if a read hangs."""
    reading = Reading(time=get_dht_time())
    reading.progress = _records(_get(dht, schema.progress_key(run_id), timeout), ProgressRecord, reading.time,
                                reading)
    reading.commits = _records(_get(dht, schema.commits_key(run_id), timeout), CommitRecord, reading.time, reading)
    signed = schema.read_owned(_get(dht, schema.run_key(run_id), timeout), schema.RunRecord, reading.time)
    fingerprint = run_fingerprint(signed)
    reading.fingerprint = short(fingerprint) if fingerprint is not None else None
    return reading


@dataclass
class Row:
    record: ProgressRecord
    live: bool


class SwarmView:
    """The monitor's bounded memory of a run; `update` from the polling thread, `snapshot` from the server's
    threads (both under one lock)."""

    def __init__(self, run_id: str, window: float):
        self.run_id, self.window = run_id, window
        self.lock = threading.Lock()
        self.peers: dict[str, Row] = {}
        self.commits: dict[str, CommitRecord] = {}
        self.evals: dict[int, dict[str, float]] = {}  # round -> peer id -> eval loss
        self.events: collections.deque[dict] = collections.deque(maxlen=MAX_EVENTS)
        self.event_counts: collections.Counter[str] = collections.Counter()
        self.refused: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self.fingerprint: Optional[str] = None
        self.commit_round = -1
        self.reads = self.failed_reads = 0
        self.last_read: Optional[float] = None

    def history(self) -> dict:
        """What a restarted monitor should still show: JSON-able, bounded."""
        with self.lock:
            return {"version": HISTORY_VERSION, "run": self.run_id, "commit_round": self.commit_round,
                    "evals": {str(r): dict(losses) for r, losses in self.evals.items()},
                    "events": list(self.events), "event_counts": dict(self.event_counts)}

    def restore(self, saved: dict) -> None:
        """Take back a `history()` of this run; ValueError naming what does not fit (a damaged or foreign file)."""
        if saved.get("version") != HISTORY_VERSION or saved.get("run") != self.run_id:
            raise ValueError(f"it is not a history of run {self.run_id!r} (version {HISTORY_VERSION})")
        try:
            evals = {int(r): {short(p): float(v) for p, v in losses.items() if math.isfinite(float(v))}
                     for r, losses in saved["evals"].items()}
            events = [{"time": float(e["time"]), "kind": short(e["kind"]), "peer": short(e["peer"]),
                       "detail": str(e["detail"])[: 4 * MAX_TEXT]} for e in saved["events"][-MAX_EVENTS:]]
            counts = {short(k): int(v) for k, v in list(saved["event_counts"].items())[:MAX_TEXT]}
            commit_round = int(saved["commit_round"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"a field does not fit ({type(e).__name__}: {e})") from None
        with self.lock:
            for round, losses in sorted(evals.items())[-MAX_ROUNDS:]:
                for peer_id, loss in list(losses.items())[:MAX_EVAL_PEERS]:
                    self._eval(peer_id, round, loss)
            self.events.extend(events)
            self.event_counts.update(counts)
            self.commit_round = max(self.commit_round, commit_round)

    def add_event(self, now: float, kind: str, peer: str = "", detail: str = "") -> None:
        with self.lock:
            self._event(now, kind, peer, detail)

    def _event(self, now: float, kind: str, peer: str, detail: str) -> None:
        self.events.append({"time": now, "kind": kind, "peer": short(peer), "detail": detail})
        self.event_counts[kind] += 1

    def read_failed(self) -> None:
        with self.lock:
            self.failed_reads += 1

    def update(self, reading: Reading, now: float) -> None:
        with self.lock:
            self.reads, self.last_read, self.fingerprint = self.reads + 1, now, reading.fingerprint
            for peer_id, record in reading.progress.items():
                self._progress(peer_id, record, now)
            for row in self.peers.values():
                live = policy.is_live(row.record, now, self.window)
                if row.live and not live:
                    self._event(now, "leave", row.record.name, f"last seen at round {row.record.round}, "
                                f"inner step {row.record.inner_step}")
                row.live = live
            if len(self.peers) > MAX_PEERS:  # the stalest go first
                keep = sorted(self.peers, key=lambda p: self.peers[p].record.time, reverse=True)[:MAX_PEERS]
                self.peers = {p: self.peers[p] for p in keep}
            self._commits(reading.commits, now)
            for subkey, why in reading.refused:
                if (subkey, why) not in self.refused:
                    self._event(now, "refused", subkey, why)
                self.refused[(subkey, why)] = None
                self.refused.move_to_end((subkey, why))
            while len(self.refused) > MAX_PEERS:
                self.refused.popitem(last=False)

    def _progress(self, peer_id: str, record: ProgressRecord, now: float) -> None:
        row = self.peers.get(peer_id)
        live = policy.is_live(record, now, self.window)
        if row is None or (live and not row.live):
            if live:
                self._event(now, "join", record.name, f"at round {record.round}")
            self.peers[peer_id] = row = Row(record, live)
        elif record.time >= row.record.time:
            row.record = record
        if record.eval_loss is not None and record.eval_round is not None:
            self._eval(peer_id, record.eval_round, record.eval_loss)

    def _eval(self, peer_id: str, round: int, loss: float) -> None:
        losses = self.evals.get(round)
        if losses is None:
            if len(self.evals) >= MAX_ROUNDS:
                oldest = min(self.evals)
                if round < oldest:
                    return
                del self.evals[oldest]
            losses = self.evals[round] = {}
        if peer_id in losses or len(losses) < MAX_EVAL_PEERS:
            losses[peer_id] = loss

    def _commits(self, commits: dict[str, CommitRecord], now: float) -> None:
        if len(commits) > MAX_PEERS:
            keep = sorted(commits, key=lambda p: (commits[p].round, commits[p].time), reverse=True)[:MAX_PEERS]
            commits = {p: commits[p] for p in keep}
        self.commits = commits
        top = max((c.round for c in commits.values()), default=-1)
        if top > self.commit_round:
            hashes = collections.Counter(c.sha256 for c in commits.values() if c.round == top)
            by = sorted(short(c.name) for c in commits.values() if c.round == top)
            self._event(now, "commit", ", ".join(by[:8]) + (" …" if len(by) > 8 else ""),
                        f"round {top}, global {(policy.winner(hashes) or '?')[:12]}")
            self.commit_round = top
