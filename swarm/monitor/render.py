"""The monitor's view as JSON (`/api/swarm`, read by the page) and as Prometheus text (`/metrics`).

`snapshot` copies the view under its lock into plain JSON types; both renderings read only that copy.
Every number from a record passes `_num` (a non-finite float becomes null: the DHT's validator lets
`time` and `samples_per_s` be NaN or infinite, and JSON has neither).

Prometheus: a private `CollectorRegistry` per scrape over one snapshot (no process-global registry), all
gauges, since a peer's counters restart with it. Per peer: `swarm_peer_round`, `swarm_peer_inner_step`,
`swarm_peer_loss`, `swarm_peer_tokens_per_second`, `swarm_peer_sent_bytes`, `swarm_peer_received_bytes`,
`swarm_peer_last_seen_seconds`, `swarm_peer_live`, labelled `peer` (name) and `peer_id`; for the run:
`swarm_peers{state}`, `swarm_commit_round`, `swarm_eval_round`, `swarm_eval_loss` (mean over the peers
that evaluated that round), `swarm_events{kind}` (seen since the monitor started), `swarm_monitor_reads{result}`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from swarm.monitor.collect import SwarmView, short


def _num(x: Optional[float]) -> Optional[float]:
    return None if x is None or not math.isfinite(x) else x


def _age(now: float, then: float) -> Optional[float]:
    """Seconds since `then`; a record stamped in the future (clocks differ) shows 0."""
    return None if not math.isfinite(now - then) else max(0.0, now - then)


def snapshot(view: SwarmView, now: float) -> dict[str, Any]:
    """The view in plain JSON types; `now` is DHT time (records' `time` and the view's clock)."""
    with view.lock:
        peers = []
        for peer_id, row in view.peers.items():
            r = row.record
            peers.append({
                "peer_id": short(peer_id), "name": short(r.name), "live": row.live, "round": r.round,
                "inner_step": r.inner_step, "loss": _num(r.loss), "tokens_per_s": _num(r.tokens_per_s),
                "samples_per_s": _num(r.samples_per_s), "bytes_sent": r.bytes_sent,
                "bytes_received": r.bytes_received, "eval_loss": _num(r.eval_loss), "eval_round": r.eval_round,
                "ready": r.ready, "serves_state": r.serves_state, "last_seen_s": _age(now, r.time),
            })
        commits = [{"peer_id": short(p), "name": short(c.name), "round": c.round, "sha256": c.sha256,
                    "age_s": _age(now, c.time)} for p, c in view.commits.items()]
        evals = [{"round": round, "mean": sum(losses.values()) / len(losses), "min": min(losses.values()),
                  "max": max(losses.values()), "peers": len(losses)}
                 for round, losses in sorted(view.evals.items()) if losses]
        out = {
            "run": view.run_id, "now": now, "live_window_s": view.window, "fingerprint": view.fingerprint,
            "reads": view.reads, "failed_reads": view.failed_reads,
            "last_read_age_s": None if view.last_read is None else _age(now, view.last_read),
            "peers": sorted(peers, key=lambda p: (not p["live"], p["name"], p["peer_id"])),
            "commits": sorted(commits, key=lambda c: (-c["round"], c["name"])),
            "eval": evals,
            "events": [{**e, "time": _num(e["time"])} for e in view.events],
            "event_counts": dict(view.event_counts),
        }
    return out


def to_json(snap: dict[str, Any]) -> bytes:
    return json.dumps(snap, allow_nan=False, separators=(",", ":")).encode()


class _Collector:
    def __init__(self, snap: dict[str, Any]):
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        snap, labels = self.snap, ["peer", "peer_id"]
        per_peer = [  # (metric, help, field)
            ("swarm_peer_round", "Outer steps the peer's global parameters hold.", "round"),
            ("swarm_peer_inner_step", "Inner steps the peer has taken.", "inner_step"),
            ("swarm_peer_loss", "Training loss of the peer's last inner step.", "loss"),
            ("swarm_peer_tokens_per_second", "Training tokens per second over the peer's round.", "tokens_per_s"),
            ("swarm_peer_sent_bytes", "All-reduce payload the peer sent since it started.", "bytes_sent"),
            ("swarm_peer_received_bytes", "All-reduce payload the peer received since it started.",
             "bytes_received"),
            ("swarm_peer_last_seen_seconds", "Age of the peer's last progress record.", "last_seen_s"),
            ("swarm_peer_live", "1 if the peer's record is fresher than the live window.", "live"),
        ]
        for name, text, key in per_peer:
            family = GaugeMetricFamily(name, text, labels=labels)
            for p in snap["peers"]:
                if p[key] is not None:
                    family.add_metric([p["name"], p["peer_id"]], float(p[key]))
            yield family
        peers = GaugeMetricFamily("swarm_peers", "Peers in the table, live or gone.", labels=["state"])
        live = sum(p["live"] for p in snap["peers"])
        peers.add_metric(["live"], live)
        peers.add_metric(["gone"], len(snap["peers"]) - live)
        yield peers
        commit = max((c["round"] for c in snap["commits"]), default=None)
        if commit is not None:
            yield GaugeMetricFamily("swarm_commit_round", "Highest round any peer committed.", value=commit)
        if snap["eval"]:
            last = snap["eval"][-1]
            yield GaugeMetricFamily("swarm_eval_round", "Latest round with an eval loss.", value=last["round"])
            yield GaugeMetricFamily("swarm_eval_loss", "Mean held-out loss of the peers at swarm_eval_round.",
                                    value=last["mean"])
        events = GaugeMetricFamily("swarm_events", "Events seen since the monitor started.", labels=["kind"])
        for kind, count in sorted(snap["event_counts"].items()):
            events.add_metric([kind], count)
        yield events
        reads = GaugeMetricFamily("swarm_monitor_reads", "DHT reads by the monitor.", labels=["result"])
        reads.add_metric(["ok"], snap["reads"])
        reads.add_metric(["timed_out"], snap["failed_reads"])
        yield reads


def to_metrics(snap: dict[str, Any]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snap))
    return generate_latest(registry)
