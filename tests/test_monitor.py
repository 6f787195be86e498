"""The monitor without a network: hand-made records folded into the view, rendered as JSON, Prometheus text and
the page, and served over loopback HTTP."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration
from prometheus_client.parser import text_string_to_metric_families

from swarm.monitor import collect
from swarm.monitor.collect import Reading, SwarmView, read_swarm
from swarm.monitor.page import PAGE
from swarm.monitor.render import snapshot, to_json, to_metrics
from swarm.monitor.server import _handler
from swarm.net import schema
from swarm.net.identity import load_identity
from swarm.net.schema import CommitRecord, ProgressRecord
from swarm.train.averaging import ExchangeOutcome, PeerStats, SoloAverager
from swarm.train.trainer import Trainer

WINDOW = 10.0
T0 = 1000.0
SHA = "a" * 64


def progress(peer: str, round: int, time: float, **extra) -> ProgressRecord:
    fields = dict(inner_step=4 * round, samples=0, samples_per_s=2.0, serves_state=True, sha256=SHA)
    return ProgressRecord(peer_id=peer, name=f"name-{peer}", round=round, time=time, **{**fields, **extra})


def reading(*records: ProgressRecord, commits=None) -> Reading:
    return Reading(progress={r.peer_id: r for r in records}, commits=commits or {})


def kinds(view: SwarmView) -> list[tuple[str, str]]:
    return [(e["kind"], e["peer"]) for e in view.events]


def test_old_records_still_parse_and_watched_numbers_keep_the_strict_check():
    old = {"peer_id": "p", "name": "p", "round": 1, "inner_step": 2, "samples": 3, "samples_per_s": 1.0,
           "time": T0, "serves_state": False}
    assert schema.parse(ProgressRecord, old).loss is None
    fields = schema.watched(loss=float("nan"), tokens_per_s=float("inf"), bytes_sent=-1, bytes_received=7,
                            eval_loss=2.5, eval_round=3)
    assert fields == dict(loss=None, tokens_per_s=None, bytes_sent=None, bytes_received=7, eval_loss=2.5, eval_round=3)
    stored = ProgressRecord(**old, **fields).dict()
    assert ProgressRecord.parse_obj(stored).dict() == stored  # what hivemind's SchemaValidator checks
    assert schema.parse(ProgressRecord, {**stored, "loss": float("nan")}) is None  # a stranger's NaN: no record
    assert schema.parse(ProgressRecord, {**stored, "bytes_sent": 1.0}) is None  # strict: no conversions


def test_joins_and_leaves_follow_the_age_of_records_not_one_missing_read():
    view = SwarmView("run", WINDOW)
    view.update(reading(progress("a", 0, T0), progress("b", 0, T0)), T0 + 1)
    assert kinds(view) == [("join", "name-a"), ("join", "name-b")]
    view.update(reading(progress("a", 1, T0 + 5)), T0 + 6)  # b missing from one read, its record still fresh
    assert [p["live"] for p in snapshot(view, T0 + 6)["peers"]] == [True, True]
    view.update(reading(progress("a", 2, T0 + 11)), T0 + 12)  # b's record is now 12 s old
    assert kinds(view)[2:] == [("leave", "name-b")]
    assert "round 0, inner step 0" in view.events[-1]["detail"]
    view.update(reading(progress("b", 3, T0 + 12)), T0 + 12.5)  # b comes back
    assert kinds(view)[3:] == [("join", "name-b")]
    view.update(reading(progress("a", 1, T0 + 2)), T0 + 12.5)  # a stale replica never moves a peer back
    assert {p["name"]: p["round"] for p in snapshot(view, T0 + 12.5)["peers"]} == {"name-a": 2, "name-b": 3}


def test_a_record_first_seen_dead_is_listed_gone_without_an_event():
    view = SwarmView("run", WINDOW)
    view.update(reading(progress("a", 0, T0)), T0 + 30)
    assert list(view.events) == []
    assert snapshot(view, T0 + 30)["peers"][0]["live"] is False


def test_eval_loss_per_round_is_the_mean_over_peers_counted_once_each():
    view = SwarmView("run", WINDOW)
    for t in (T0, T0 + 1):  # the heartbeat re-sends the same eval: counted once
        view.update(reading(progress("a", 1, t, eval_loss=3.0, eval_round=1),
                            progress("b", 1, t, eval_loss=2.0, eval_round=1)), t)
    view.update(reading(progress("a", 2, T0 + 2, eval_loss=1.5, eval_round=2)), T0 + 2)
    assert snapshot(view, T0 + 2)["eval"] == [
        {"round": 1, "mean": 2.5, "min": 2.0, "max": 3.0, "peers": 2},
        {"round": 2, "mean": 1.5, "min": 1.5, "max": 1.5, "peers": 1}]


def test_memory_stays_bounded_against_a_flood_of_records(monkeypatch):
    monkeypatch.setattr(collect, "MAX_ROUNDS", 5)
    monkeypatch.setattr(collect, "MAX_EVAL_PEERS", 3)
    view = SwarmView("run", WINDOW)
    flood = [progress(f"p{i}", i, T0 + i / 1000, eval_loss=1.0, eval_round=i % 8) for i in range(collect.MAX_PEERS + 44)]
    view.update(reading(*flood), T0 + 1)
    assert len(view.peers) == collect.MAX_PEERS
    assert min(r.record.round for r in view.peers.values()) == 44  # the stalest went first
    assert sorted(view.evals) == [3, 4, 5, 6, 7]  # the latest MAX_ROUNDS rounds
    assert all(len(losses) == 3 for losses in view.evals.values())
    for i in range(collect.MAX_EVENTS + 10):
        view.add_event(T0, "kill", f"p{i}")
    assert len(view.events) == collect.MAX_EVENTS and view.event_counts["kill"] == collect.MAX_EVENTS + 10


def test_commit_event_when_the_swarm_reaches_a_new_round():
    view = SwarmView("run", WINDOW)
    commits = {p: CommitRecord(name=f"name-{p}", round=3, sha256=SHA, time=T0) for p in "ab"}
    view.update(reading(commits=commits), T0)
    view.update(reading(commits=commits), T0 + 1)
    view.update(reading(commits={**commits, "a": CommitRecord(name="name-a", round=4, sha256="b" * 64, time=T0)}),
                T0 + 2)
    assert [(e["kind"], e["peer"], e["detail"]) for e in view.events] == [
        ("commit", "name-a, name-b", f"round 3, global {SHA[:12]}"), ("commit", "name-a", "round 4, global bbbbbbbbbbbb")]


class FakeDHT:
    """`get(key, latest=True, return_future=True).result(timeout)` over a dict of raw DHT values."""

    def __init__(self, values: dict, hang: bool = False):
        self.values, self.hang = values, hang

    def get(self, key, latest, return_future):
        assert latest and return_future

        def result(timeout):
            if self.hang:
                raise TimeoutError
            return self.values.get(key)
        return SimpleNamespace(result=result)


def test_read_swarm_types_records_and_reports_the_ones_it_refuses():
    now = time.time()  # read_swarm drops what expired by the clock
    a, b, c, d = (load_identity(None) for _ in range(4))
    good = progress(str(a.peer_id), 1, T0).dict()
    items = {a.owner: ValueWithExpiration(good, now + 60), b.owner: ValueWithExpiration(good, now + 60),  # a's id
             c.owner: ValueWithExpiration({"round": "x"}, now + 60), d.owner: ValueWithExpiration(good, 1.0),  # expired
             "e": ValueWithExpiration(good, now + 60)}  # no owner key
    commit = CommitRecord(name="a", round=1, sha256=SHA, time=T0).dict()
    run = schema.RunRecord(fingerprint="fp123", time=T0).dict()
    dht = FakeDHT({schema.progress_key("run"): ValueWithExpiration(items, now + 60),
                   schema.commits_key("run"): ValueWithExpiration({a.owner: ValueWithExpiration(commit, now + 60)},
                                                                  now + 60),
                   schema.run_key("run"): ValueWithExpiration({a.owner: ValueWithExpiration(run, now + 60)}, now + 60)})
    got = read_swarm(dht, "run", timeout=1.0)
    assert list(got.progress) == [str(a.peer_id)] and got.progress[str(a.peer_id)].round == 1
    assert got.commits[str(a.peer_id)].round == 1 and got.fingerprint == "fp123"
    assert got.refused == [(str(b.peer_id), f"ProgressRecord: claims peer id {a.peer_id}"),
                           (str(c.peer_id), "ProgressRecord: does not fit the schema"),
                           ("e", "ProgressRecord: not owned by a peer key")]
    view = SwarmView("run", WINDOW)
    view.update(got, T0 + 1)
    view.update(got, T0 + 2)  # the same refusals again: one event each
    assert [e for e in kinds(view) if e[0] == "refused"] == [("refused", str(p)) for p in (b.peer_id, c.peer_id)] + [
        ("refused", "e")]
    with pytest.raises(TimeoutError):
        read_swarm(FakeDHT({}, hang=True), "run", timeout=1.0)
    assert read_swarm(FakeDHT({}), "run", timeout=1.0).progress == {}


def sample_view() -> SwarmView:
    view = SwarmView("run", WINDOW)
    view.update(reading(progress("a", 2, T0, loss=2.25, tokens_per_s=1000.0, bytes_sent=10, bytes_received=20,
                                 eval_loss=3.0, eval_round=2),
                        progress("b", 1, T0 - 30),
                        progress("c", 2, float("nan"), samples_per_s=float("inf")),  # a stranger's odd numbers
                        commits={"a": CommitRecord(name="name-a", round=2, sha256=SHA, time=T0)}), T0)
    return view


def test_json_has_every_column_and_no_non_finite_number():
    snap = json.loads(to_json(snapshot(sample_view(), T0 + 1)))
    a, c = (next(p for p in snap["peers"] if p["name"] == n) for n in ("name-a", "name-c"))
    assert (a["round"], a["inner_step"], a["loss"], a["tokens_per_s"], a["bytes_sent"], a["bytes_received"],
            a["last_seen_s"], a["live"]) == (2, 8, 2.25, 1000.0, 10, 20, 1.0, True)
    assert c["last_seen_s"] is None and c["samples_per_s"] is None and c["live"] is False
    assert [p["live"] for p in snap["peers"]] == [True, False, False]  # live peers first
    assert snap["eval"] == [{"round": 2, "mean": 3.0, "min": 3.0, "max": 3.0, "peers": 1}]
    assert snap["commits"][0]["round"] == 2 and snap["event_counts"] == {"join": 1, "commit": 1}


def test_metrics_parse_as_prometheus_text_with_per_peer_gauges():
    text = to_metrics(snapshot(sample_view(), T0 + 1)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    rounds = {s.labels["peer"]: s.value for s in families["swarm_peer_round"].samples}
    assert rounds == {"name-a": 2.0, "name-b": 1.0, "name-c": 2.0}
    assert families["swarm_peer_round"].type == "gauge"
    assert {s.labels["peer"]: s.value for s in families["swarm_peer_loss"].samples} == {"name-a": 2.25}
    assert {s.labels["state"]: s.value for s in families["swarm_peers"].samples} == {"live": 1.0, "gone": 2.0}
    assert families["swarm_eval_loss"].samples[0].value == 3.0
    assert families["swarm_commit_round"].samples[0].value == 2.0
    assert all(math.isfinite(s.value) for f in families.values() for s in f.samples)


def test_the_page_is_self_contained_and_never_injects_html():
    assert "http://" not in PAGE.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in PAGE and "innerHTML" not in PAGE
    assert 'fetch("/api/swarm"' in PAGE


def test_http_routes():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    server.RequestHandlerClass = _handler(SimpleNamespace(view=sample_view()))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        page = urllib.request.urlopen(base + "/", timeout=10)
        assert page.headers["Content-Type"].startswith("text/html") and b"<svg" in page.read()
        api = json.loads(urllib.request.urlopen(base + "/api/swarm", timeout=10).read())
        assert {p["name"] for p in api["peers"]} == {"name-a", "name-b", "name-c"}
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10)
        assert metrics.headers["Content-Type"].startswith("text/plain") and b"swarm_peer_round" in metrics.read()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(base + "/nope", timeout=10)
        assert missing.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


class Watched(SoloAverager):
    """Solo averaging that keeps what the trainer publishes, with pretend all-reduce bytes."""

    def __init__(self):
        self.published: list[tuple[int, PeerStats]] = []

    def average(self, *args, **kwargs) -> ExchangeOutcome:
        return dataclasses.replace(super().average(*args, **kwargs), bytes_sent=100, bytes_received=70)

    def publish_progress(self, round, inner_step, samples, samples_per_s, ready=False, sha256="", stats=None):
        if stats is not None:
            self.published.append((round, stats, samples_per_s))


def test_the_trainer_publishes_plain_numbers_for_watchers(tmp_path, tiny):
    averager = Watched()
    trainer = Trainer(tiny, averager, "w", shard=0, out_dir=tmp_path)
    history = trainer.train()
    rounds = len(history.rounds)
    assert rounds == tiny.diloco.rounds == 3
    first, (last_round, last, _) = averager.published[0], averager.published[-1]
    assert first[1].eval_round == 0 and first[1].eval_loss == history.initial_eval_loss  # the eval before training
    assert first[1].bytes_sent == 0 and first[1].tokens_per_s == first[2] * tiny.data.seq_len
    assert math.isfinite(first[1].loss)
    # after the last round: its eval, the byte totals, its mean train loss
    assert (last_round, last.eval_round, last.eval_loss) == (3, 3, history.rounds[-1].eval_loss)
    assert (last.bytes_sent, last.bytes_received) == (100 * rounds, 70 * rounds)
    assert last.loss == history.rounds[-1].train_loss


def test_the_history_outlives_the_monitor_and_a_damaged_one_is_set_aside(tmp_path, caplog):
    from swarm.monitor.server import load_history

    view = SwarmView("run", WINDOW)
    view.update(reading(progress("a", 2, T0, eval_loss=2.5, eval_round=2),
                        commits={"a": CommitRecord(name="a", round=2, sha256=SHA, time=T0)}), T0 + 1)
    path = tmp_path / "history.json"
    path.write_text(json.dumps(view.history()))
    again = SwarmView("run", WINDOW)  # a restarted monitor
    load_history(again, path)
    assert again.evals == {2: {"a": 2.5}} and list(again.events) == list(view.events)
    assert again.commit_round == 2 and again.peers == {}  # the peer table is read anew
    again.update(reading(commits={"a": CommitRecord(name="a", round=2, sha256=SHA, time=T0)}), T0 + 2)
    assert kinds(again) == kinds(view)  # the commit of round 2 was seen before the restart: no second event
    other = SwarmView("another-run", WINDOW)
    load_history(other, path)  # another run's history: set aside, never mixed in
    assert other.evals == {} and (tmp_path / "history.json.bad").exists() and not path.exists()
    path.write_text('{"version": 1, "run": "run", "evals": {"x": 1}}')
    load_history(SwarmView("run", WINDOW), path)
    assert "unreadable" in caplog.text
