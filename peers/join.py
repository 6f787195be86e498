"""`swarm join RUN`: a peer started from the run's manifest; `swarm runs`: the runs a DHT advertises.

`swarm join` takes no config file. It checks the overrides first (only `config.PER_PEER_KEYS` may be
overridden: anything else would make this peer run another run, exit 2 naming the key and listing those it
takes), reads and checks
the run's manifest through a short-lived client DHT (swarm/net/manifest.py; waits at most
`swarm.bootstrap_timeout`, exit 1 naming the run and the DHT asked if no manifest answers, or why the one
found is refused), then starts a peer exactly like `swarm peer` (peers/node.py) on the manifest's config with
the overrides applied (with `--nproc-per-node K`: `swarm peer` on K ranks, on that config written to
`<out>/config.yaml`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from hivemind.utils.timed_storage import get_dht_time

from swarm.config import CORPUS_LOCATION_KEYS, Config, SwarmConfig, is_per_peer, joinable_keys, live_window
from swarm.errors import SwarmError, UsageError
from swarm.net import policy, schema
from swarm.net.manifest import ManifestRefused, choose_manifest, fetch_manifest
from swarm.net.policy import run_fingerprint
from swarm.net.schema import CommitRecord, IndexRecord, ManifestRecord, ProgressRecord, RunRecord
from swarm.run.configfile import config_from_dict, deep_merge, load_config, parse_overrides
from swarm.run.runid import RunIdentity

log = logging.getLogger("swarm.join")

READ_TIMEOUT = 10.0
"""`swarm runs` gives the DHT this long to answer all its reads: past it, the DHT is not answering (a slow
one answers loopback reads in milliseconds and remote ones in about a second)."""


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


DEMANDS = frozenset({"swarm.identity_work"})
"""Keys `swarm join` takes although the run fixes them: what the joiner demands while it reads the manifest
(`swarm.identity_work`: count only the manifests of signers with that much proof of work, so that free
identities cannot outvote the run's peers), never merged over the manifest's config."""


def check_overrides(run_id: str, overrides: list[str]) -> dict[str, Any]:
    """The overrides as nested dicts; UsageError (exit 2) naming the first one that is not a per-peer key
    (or one of DEMANDS)."""
    if any(arg == "--config" or arg.startswith("--config=") for arg in overrides):
        raise UsageError(f"swarm join takes no --config: the config of run {run_id!r} comes from its manifest")
    parsed = parse_overrides(overrides)
    for key in _leaves(parsed):
        if not is_per_peer(key) and key not in DEMANDS and key not in CORPUS_LOCATION_KEYS:
            raise UsageError(f"cannot override {key} when joining run {run_id!r}: it is fixed by the run's "
                             f"manifest (a joiner may set only {', '.join(joinable_keys())})")
    return parsed


def probe_config(own: SwarmConfig, run_id: str) -> SwarmConfig:
    """A short-lived DHT client of run `run_id` that only reads (the manifest, who is live) and fetches: a fresh
    key, and any free port (the peer's own DHT binds the chosen ones right after)."""
    return dataclasses.replace(own, run_id=run_id, client_mode=True, identity=None, announce_maddrs=[],
                               host_maddrs=[re.sub(r"/(tcp|udp)/\d+", r"/\1/0", m) for m in own.host_maddrs])


def joined_config(run_id: str, initial_peers: list[str], overrides: list[str]) -> tuple[Config, RunIdentity]:
    """The config `swarm join` starts its peer with (the run's manifest plus this peer's overrides), and the
    run's identity as its manifest gives it."""
    from swarm.net.dht import start_dht

    parsed = check_overrides(run_id, overrides)
    deep_merge(parsed, {"swarm": {"initial_peers": list(initial_peers)}})
    own = load_config(None, {"swarm": parsed["swarm"]}).swarm  # addresses and bootstrap_timeout, checked
    probe = probe_config(own, run_id)
    dht = start_dht(probe)
    try:
        choice = fetch_manifest(dht, run_id, probe.initial_peers, probe.bootstrap_timeout, own.identity_work)
    finally:
        dht.shutdown()
    parsed["swarm"].pop("identity_work", None)  # a demand on the signers, not this peer's config: the run's holds
    log.info("run %r: manifest of fingerprint %s, created by %s, signed by %d peer(s)", run_id,
             choice.record.fingerprint, choice.record.creator, len(choice.signers))
    return config_from_dict(deep_merge(json.loads(json.dumps(choice.shared)), parsed)), choice.run


def write_config(cfg: Config, path: Path) -> Path:
    """`cfg` as a YAML config file (`swarm join --nproc-per-node K` hands it to `swarm peer` on K ranks)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


@dataclass
class RunRow:
    """One line of `swarm runs`."""

    run_id: str
    round: Optional[int]  # the round most live peers are at (none live: most commit records name); None: unknown
    live_peers: int
    params: Optional[int]
    fingerprint: Optional[str]
    manifest: str  # "ok" (`swarm join` can start from it), "none" or "refused"


def describe_run(run_id: str, entries: dict[str, IndexRecord], progress: dict[str, ProgressRecord],
                 commits: dict[str, CommitRecord], runs: dict[str, RunRecord], manifests: dict[str, ManifestRecord],
                 now: float) -> RunRow:
    """A run's line from its signed records (by signer). Every number is a majority of signers, so one
    stranger cannot move it: the round most live peers hold, the parameter count most index entries of the
    run's fingerprint give. Liveness uses the run's own `live_window` when its manifest is readable."""
    fingerprint = run_fingerprint(runs)
    try:
        window, manifest = live_window(choose_manifest(run_id, manifests, fingerprint).config.swarm), "ok"
    except ManifestRefused:
        window, manifest = live_window(SwarmConfig()), "refused" if manifests else "none"
    live = [r for r in progress.values() if policy.is_live(r, now, window)]
    steps = (collections.Counter(r.outer_step for r in live)
             or collections.Counter(c.outer_step for c in commits.values()))
    params = collections.Counter(e.params for e in entries.values() if fingerprint in (None, e.fingerprint))
    return RunRow(run_id, max(steps, key=lambda s: (steps[s], s)) if steps else None, len(live),
                  max(params, key=lambda p: (params[p], p)) if params else None, fingerprint, manifest)


def read_runs(initial_peers: list[str], bootstrap_timeout: float) -> list[RunRow]:
    """The runs the DHT of `initial_peers` advertises (at most MAX_RUNS_SHOWN), live ones first."""
    from swarm.net.dht import start_dht
    from swarm.net.manifest import read_index

    dht = start_dht(SwarmConfig(initial_peers=list(initial_peers), client_mode=True,
                                bootstrap_timeout=bootstrap_timeout))
    try:
        deadline = time.monotonic() + READ_TIMEOUT
        try:
            index = read_index(dht, READ_TIMEOUT)
            keys = {run_id: [key(run_id) for key in (schema.progress_key, schema.commits_key, schema.run_key,
                                                      schema.manifest_key)] for run_id in index}
            futures = {key: dht.get(key, latest=True, return_future=True) for ks in keys.values() for key in ks}
            found = {key: f.result(timeout=max(0.1, deadline - time.monotonic())) for key, f in futures.items()}
        except concurrent.futures.TimeoutError:
            raise SwarmError(f"the DHT of {', '.join(initial_peers)} did not answer within "
                             f"{READ_TIMEOUT:g} s") from None
    finally:
        dht.shutdown()
    now = get_dht_time()
    rows = []
    for run_id, (progress, commits, runs, manifests) in keys.items():
        rows.append(describe_run(
            run_id, index[run_id], schema.read_owned(found[progress], ProgressRecord, now),
            schema.read_owned(found[commits], CommitRecord, now), schema.read_owned(found[runs], RunRecord, now),
            schema.read_owned(found[manifests], ManifestRecord, now), now))
    return sorted(rows, key=lambda row: (-row.live_peers, row.run_id))


def _count(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def format_runs(rows: list[RunRow]) -> str:
    header = f"{'run':<32}{'round':>6}{'live peers':>12}{'parameters':>12}  {'fingerprint':<18}manifest"
    lines = [header, "-" * len(header)]
    for row in rows:
        name = "".join(c if c.isprintable() else "?" for c in row.run_id)  # a stranger may name a run
        name = name if len(name) <= 31 else name[:30] + "…"
        lines.append(f"{name:<32}{'-' if row.round is None else row.round:>6}{row.live_peers:>12}"
                     f"{_count(row.params):>12}  {(row.fingerprint or '-')[:16]:<18}{row.manifest}")
    return "\n".join(lines)


def run_runs(initial_peers: list[str], bootstrap_timeout: float) -> int:
    """`swarm runs`: print the table (or one line if the DHT advertises no run); exit 0."""
    rows = read_runs(initial_peers, bootstrap_timeout)
    if not rows:
        print(f"no runs advertised in the DHT of {', '.join(initial_peers)}")
    else:
        print(format_runs(rows))
    return 0
