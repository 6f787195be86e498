"""A run's manifest and the run index: how a peer joins a run by name and how runs are listed.

Layout of both records: schema.py (`{run_id}_manifest`, `swarm_runs`). This module builds them, stores them
(`publish`, from a peer after it signed the run's fingerprint) and reads them back with every check:

- a manifest counts only if it is for the run's fingerprint (the one most peers signed under `{run_id}_run`,
  `policy.run_fingerprint`), its config loads with this version (`config_from_dict`: unknown keys, bad types
  and broken rules refuse it), names this run, reproduces that fingerprint, and sets no per-peer key (a
  manifest must not choose a joiner's files, key or fault injection);
- among the manifests that count, the config the most peers signed wins (ties: the earliest). Each peer
  signs one vote with its own key, so a stranger adds one vote and cannot alter anyone's: like the
  fingerprint, this holds while honest peers are the majority of those who signed; a private swarm
  (`swarm.auth: allowlist`) keeps strangers from writing at all.

A signature that does not verify never gets this far: DHT nodes and readers drop the record (hivemind's
`RSASignatureValidator`, installed by `schema.validators`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import time
from dataclasses import dataclass
from typing import Optional

import hivemind
from hivemind.utils.timed_storage import get_dht_time
from pydantic.v1 import BaseModel, ValidationError

from swarm.config import Config, ConfigError, is_per_peer, shared_config
from swarm.errors import SwarmError
from swarm.net import schema
from swarm.net.identity import Identity
from swarm.net.policy import run_fingerprint
from swarm.net.schema import IndexRecord, ManifestRecord
from swarm.run.configfile import config_from_dict
from swarm.run.runid import RunIdentity

logger = logging.getLogger(__name__)

READ_INTERVAL = 1.0
"""Seconds between two reads while a manifest is looked for: a record stored a moment ago reaches the
nodes a reader asks within a few reads."""


class ManifestRefused(SwarmError):
    """No manifest of the run passes the checks; the message says why the best one failed."""


def _canonical(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def check_manifest(run_id: str, record: ManifestRecord, fingerprint: str) -> Config:
    """The config of `record` (per-peer keys at their defaults) if it is a manifest of run `run_id` at
    `fingerprint`; ManifestRefused naming why not."""
    if record.version > schema.MANIFEST_VERSION:
        raise ManifestRefused(f"manifest version {record.version} is newer than this swarm reads "
                              f"({schema.MANIFEST_VERSION}): upgrade swarm")
    if record.fingerprint != fingerprint:
        raise ManifestRefused(f"it is for fingerprint {record.fingerprint}, the run's peers signed {fingerprint}")
    for section, values in record.config.items():
        for key in [section] if is_per_peer(section) else [f"{section}.{k}" for k in values]:
            if is_per_peer(key):
                raise ManifestRefused(f"it sets {key}, which is each peer's own")
    try:
        cfg = config_from_dict(json.loads(json.dumps(record.config)))  # a deep copy: loading keeps lists
    except ConfigError as e:
        raise ManifestRefused(f"this version cannot read its config ({e})") from None
    if cfg.swarm.run_id != run_id:
        raise ManifestRefused(f"its config is for run {cfg.swarm.run_id!r}")
    if (found := identity_of(record, cfg).fingerprint) != fingerprint:
        raise ManifestRefused(f"its config gives fingerprint {found}, not the run's {fingerprint}")
    return cfg


def identity_of(record: ManifestRecord, cfg: Config) -> RunIdentity:
    """The run identity a manifest describes (`cfg`: its config, loaded)."""
    return RunIdentity(shared_config(cfg), record.corpus_sha256, record.weights_sha256)


@dataclass
class Choice:
    """The manifest a reader believes."""

    config: Config  # loaded from the manifest: per-peer keys at their defaults
    shared: dict[str, dict]  # the manifest's config, as stored
    record: ManifestRecord
    signers: list[str]  # peer ids that signed this very config

    @property
    def run(self) -> RunIdentity:
        return identity_of(self.record, self.config)


def choose_manifest(run_id: str, manifests: dict[str, ManifestRecord], fingerprint: Optional[str]) -> Choice:
    """The config most signers of a valid manifest hold (ties: the earliest signed); ManifestRefused if no
    manifest passes `check_manifest` (the reason given is the one most manifests failed on)."""
    if fingerprint is None:
        raise ManifestRefused(f"no peer of run {run_id!r} signed its fingerprint")
    if not manifests:
        raise ManifestRefused(f"run {run_id!r} has no manifest (its peers may run a swarm without `swarm join`)")
    valid: dict[str, list[tuple[str, ManifestRecord, Config]]] = {}
    reasons: collections.Counter[str] = collections.Counter()
    for peer_id, record in manifests.items():
        try:
            cfg = check_manifest(run_id, record, fingerprint)
        except ManifestRefused as e:
            reasons[str(e)] += 1
            continue
        valid.setdefault(_canonical(record.config), []).append((peer_id, record, cfg))
    if not valid:
        reason = max(reasons, key=lambda r: (reasons[r], r))
        raise ManifestRefused(f"manifest of run {run_id!r} refused: {reason}")
    best = min(valid.values(), key=lambda signed: (-len(signed), min(r.time for _, r, _ in signed)))
    _, record, cfg = min(best, key=lambda item: item[1].time)
    return Choice(cfg, record.config, record, sorted(peer_id for peer_id, _, _ in best))


def _get(dht: hivemind.DHT, key: str):
    return dht.get(key, latest=True, return_future=True)


def read_manifests(dht: hivemind.DHT, run_id: str, timeout: float,
                   work: int = 0) -> tuple[Optional[str], dict[str, ManifestRecord]]:
    """The run's fingerprint (majority of its signed run records) and its manifests by signer, of the signers
    with `work` bits of proof of work (swarm.identity_work); a read that does not answer within `timeout`
    raises TimeoutError (it must not look like a run without a manifest)."""
    runs, manifests = _get(dht, schema.run_key(run_id)), _get(dht, schema.manifest_key(run_id))
    deadline = time.monotonic() + timeout
    signed = runs.result(timeout=timeout)
    found = manifests.result(timeout=max(0.0, deadline - time.monotonic()))
    now = get_dht_time()
    return (run_fingerprint(schema.read_owned(signed, schema.RunRecord, now, work)),
            schema.read_owned(found, ManifestRecord, now, work))


def fetch_manifest(dht: hivemind.DHT, run_id: str, initial_peers: list[str], wait: float, work: int = 0) -> Choice:
    """The run's manifest, read every READ_INTERVAL s for at most `wait` s (records propagate), counting only
    signers with `work` bits of proof of work; SwarmError if none answers, ManifestRefused once two reads in
    a row find manifests and refuse them all."""
    deadline = time.monotonic() + wait
    refused: Optional[ManifestRefused] = None
    hint = "is the run name right?"
    while True:
        try:
            fingerprint, manifests = read_manifests(dht, run_id, max(0.1, deadline - time.monotonic()), work)
            return choose_manifest(run_id, manifests, fingerprint)
        except ManifestRefused as e:
            if manifests and fingerprint is not None:
                if refused is not None:
                    raise e from None
                refused = e
            elif fingerprint is not None:
                hint = (f"its peers signed fingerprint {fingerprint} but stored no manifest (a swarm without "
                        f"`swarm join`?)")
        except concurrent.futures.TimeoutError:
            pass
        if time.monotonic() + READ_INTERVAL > deadline:
            if refused is not None:
                raise refused from None
            raise SwarmError(f"no manifest of run {run_id!r} in the DHT of {', '.join(initial_peers)} within "
                             f"{wait:g} s (swarm.bootstrap_timeout): {hint}")
        time.sleep(READ_INTERVAL)


def _store(dht: hivemind.DHT, key: str, value: dict, identity: Identity, timeout: float, what: str) -> None:
    now = get_dht_time()
    future = dht.store(key, value, subkey=identity.owner, expiration_time=now + schema.RUN_RECORD_EXPIRATION,
                       return_future=True)
    try:
        if not future.result(timeout=timeout):
            logger.warning("%s was not stored (no DHT peer accepted it)", what)
    except concurrent.futures.TimeoutError:
        logger.warning("%s not confirmed within %g s", what, timeout)


def _record(model: type[BaseModel], what: str, **fields) -> Optional[dict]:
    """The record's value, or None with a warning when this run's config does not fit the schema (a config
    over MAX_MANIFEST_BYTES, e.g. thousands of `swarm.allowed_peers`; a run id over 128 characters): the
    peer trains on, its run just cannot be joined by name or listed."""
    try:
        return model(**fields).dict()
    except ValidationError as e:
        logger.warning("%s is not published: %s", what, "; ".join(err["msg"] for err in e.errors()))
        return None


def publish(dht: hivemind.DHT, cfg: Config, run: RunIdentity, identity: Identity, params: int) -> None:
    """After this peer signed the run's fingerprint: store its copy of the run's manifest where the run has
    none, or fewer than MANIFEST_COPIES of the config this peer runs, and its index entry where the run has
    fewer than INDEX_COPIES (an open run only). Each DHT call is bounded by `swarm.request_timeout`; one that
    fails only leaves fewer copies (a warning), never stops the peer."""
    s = cfg.swarm
    peer_id, fingerprint, shared = identity.peer_id.to_base58(), run.fingerprint, run.config
    try:
        run_fp, manifests = read_manifests(dht, s.run_id, s.request_timeout, s.identity_work)
    except concurrent.futures.TimeoutError:
        logger.warning("run %r: the manifest read did not answer within %g s; not publishing it", s.run_id,
                       s.request_timeout)
        return
    if run_fp not in (None, fingerprint):  # another majority signed since check_fingerprint let us in
        return
    try:  # None: our own run record, signed a moment ago, has not reached the nodes we read
        choice: Optional[Choice] = choose_manifest(s.run_id, manifests, fingerprint)
    except ManifestRefused:
        choice = None
    creator = None
    if choice is None:
        creator = peer_id
    elif (_canonical(choice.shared) == _canonical(shared) and peer_id not in choice.signers
          and len(choice.signers) < schema.MANIFEST_COPIES):
        creator = choice.record.creator
    if creator is not None:
        what = f"the manifest of run {s.run_id!r}"
        record = _record(ManifestRecord, what, config=shared, fingerprint=fingerprint, creator=creator,
                         time=get_dht_time(), version=schema.MANIFEST_VERSION, corpus_sha256=run.corpus_sha256,
                         weights_sha256=run.weights_sha256, work=identity.work)
        if record is not None:
            _store(dht, schema.manifest_key(s.run_id), record, identity, s.request_timeout, what)
    if s.auth != "open":
        return
    try:
        index = read_index(dht, s.request_timeout)
    except concurrent.futures.TimeoutError:
        logger.warning("the run index did not answer within %g s; not advertising run %r", s.request_timeout,
                       s.run_id)
        return
    ours = {p for p, e in index.get(s.run_id, {}).items() if e.fingerprint == fingerprint}
    if peer_id not in ours and len(ours) < schema.INDEX_COPIES:
        what = f"the index entry of run {s.run_id!r}"
        entry = _record(IndexRecord, what, run_id=s.run_id, fingerprint=fingerprint, params=params,
                        time=get_dht_time())
        if entry is not None:
            _store(dht, schema.INDEX_KEY, entry, identity, s.request_timeout, what)


def read_index(dht: hivemind.DHT, timeout: float) -> dict[str, dict[str, IndexRecord]]:
    """The run index: run id -> {signer peer id: entry}, the MAX_RUNS_SHOWN runs with the latest entries."""
    entries = schema.read_owned(_get(dht, schema.INDEX_KEY).result(timeout=timeout), IndexRecord, get_dht_time())
    runs: dict[str, dict[str, IndexRecord]] = {}
    for peer_id, entry in entries.items():
        runs.setdefault(entry.run_id, {})[peer_id] = entry
    latest = sorted(runs, key=lambda r: max(e.time for e in runs[r].values()), reverse=True)
    return {run_id: runs[run_id] for run_id in latest[: schema.MAX_RUNS_SHOWN]}
