"""The trainer never waits on the DHT: its progress records and commit records are stored by the heartbeat
thread, which does not wait for the DHT's answers either (swarm/net/records.py)."""

import concurrent.futures
import gc
import threading
import weakref
from types import SimpleNamespace

import pytest

from swarm.config import SwarmConfig
from swarm.net import schema
from swarm.net.access import Access
from swarm.net.hostile import Hooks
from swarm.net.matchmaking import GroupMeta
from swarm.net.records import Records


class _SilentDHT:
    """A DHT that takes every store and never answers (a link saturated by an all-reduce, for ever)."""

    def __init__(self):
        self.stored = []

    def store(self, key, value, subkey, expiration_time, return_future):
        self.stored.append((key, value))
        return concurrent.futures.Future()


class _LateDHT(_SilentDHT):
    """Answers later, and like hivemind's MPFuture holds only a weak reference to each future it will answer."""

    def store(self, key, value, subkey, expiration_time, return_future):
        future = super().store(key, value, subkey, expiration_time, return_future)
        self.pending = [*getattr(self, "pending", []), weakref.ref(future)]
        return future

    def answer(self) -> None:
        for ref in self.pending:
            if (future := ref()) is not None:
                future.set_result(True)


def _records(dht) -> Records:
    return Records(SwarmConfig(request_timeout=600.0, progress_interval=600.0), dht, "me", "peer-0", b"o", Access(),
                   Hooks(), SimpleNamespace(snapshot=None))


@pytest.mark.timeout(30)
def test_the_trainer_and_the_heartbeat_never_wait_for_the_dht():
    """With a DHT that never confirms a store (request_timeout 600 s), publishing progress and offering a
    state return at once, and the heartbeat stores the commit record, then the progress record, and goes on:
    a second publish is stored too. The state is served only once its commit record is confirmed."""
    dht = _SilentDHT()
    records = _records(dht)
    records.start()
    snapshot = SimpleNamespace(outer_step=3, sha256="ab" * 32)
    records.offer_state(snapshot)
    records.publish_progress(3, 7, 56, 1.0, ready=True, sha256="ab" * 32)
    stored_steps = lambda: [value["inner_step"] for key, value in dht.stored if "inner_step" in value]  # noqa: E731
    while 7 not in stored_steps():
        threading.Event().wait(0.01)
    records.publish_progress(3, 9, 72, 1.0, ready=True, sha256="ab" * 32)
    while 9 not in stored_steps():
        threading.Event().wait(0.01)
    records.close()  # stops the heartbeat; nothing left to store
    keys = [key for key, _ in dht.stored]
    assert keys[0] == schema.commits_key("swarm-tiny") and set(keys[1:]) == {schema.progress_key("swarm-tiny")}
    assert stored_steps() == sorted(stored_steps()) and stored_steps()[-1] == 9
    assert records.serving is None  # its commit record never confirmed: not served yet


@pytest.mark.timeout(30)
def test_a_state_is_served_once_its_commit_record_is_confirmed_later():
    """The heartbeat does not wait for the commit record's store; when the DHT answers later, the peer serves
    the state (hivemind answers only futures someone still holds: the peer keeps them until answered)."""
    dht = _LateDHT()
    records = _records(dht)
    snapshot = SimpleNamespace(outer_step=3, sha256="ab" * 32)
    records.offer_state(snapshot)
    records.flush_commit(wait=False)
    gc.collect()
    assert records.serving is None and records.unconfirmed == 1
    dht.answer()
    assert records.serving is snapshot and records.unconfirmed == 0


def test_a_live_peer_s_record_that_one_read_misses_is_still_there():
    """A read answered by a DHT node that lacks a peer's record (its store missed that replica) must not make
    a live peer vanish; once its record is past the live window it goes."""
    from hivemind.utils import get_dht_time

    from swarm.config import live_window

    cfg = SwarmConfig(request_timeout=600.0, progress_interval=600.0)
    window = live_window(cfg)

    def progress(peer: str, age: float) -> schema.ProgressRecord:
        return schema.ProgressRecord(peer_id=peer, name=peer, round=2, inner_step=0, samples=0, samples_per_s=0.0,
                                     time=get_dht_time() - age, serves_state=True)
    records = _records(_SilentDHT())
    answers = iter([{"a": progress("a", 1.0), "b": progress("b", 1.0), "old": progress("old", window - 0.2)},
                    {"a": progress("a", 0.5)},
                    {"a": progress("a", 0.2)}])
    records.read = lambda key, model: next(answers)
    assert sorted(r.peer_id for r in records.peers()) == ["a", "b", "old"]
    second = {r.peer_id: r for r in records.peers()}
    assert sorted(second) == ["a", "b", "old"] and second["a"].time > second["b"].time  # the newer of a's
    threading.Event().wait(0.3)  # old's record ages out of the window: remembered no longer
    assert sorted(r.peer_id for r in records.peers()) == ["a", "b"]


def test_the_records_keep_their_wire_names_and_read_them_as_outer_steps():
    """schema.WIRE_NAMES: a record's field keeps the name every version stores (`round`), and the code reads it by
    the glossary's word (`outer_step`)."""
    statement = schema.Statement(round=3, parent="a" * 64, sha256="b" * 64, group="", size=1)
    progress = schema.ProgressRecord(peer_id="p", name="n", round=3, inner_step=0, samples=0, samples_per_s=0.0,
                                     time=1.0, serves_state=True, statement=statement)
    commit = schema.CommitRecord(name="n", round=3, sha256="b" * 64, time=1.0, statements=[statement])
    meta = GroupMeta(round=3, nonce="0" * 16, token=1.0)
    for record in (statement, progress, commit, meta):
        wire = record.dict()
        for code, name in schema.WIRE_NAMES.items():
            assert getattr(record, code) == wire[name] == 3 and code not in wire, type(record).__name__


@pytest.mark.timeout(30)
def test_the_progress_record_moves_with_a_commit_and_is_not_ready_any_more():
    """A peer ready for outer step 3 commits it (offer_state of outer step 4): the heartbeat stores the commit
    record, then a progress record at outer step 4, on the new hash, not ready, at the same inner step. Before, it
    re-stored the record ready at outer step 3 until the trainer's next one, an inner step later: a joiner that
    finished taking the state of step 3 meanwhile took us for groupmates waiting to average it, cut its round
    short and waited in matchmaking for a group nobody would form."""
    dht = _SilentDHT()
    records = _records(dht)
    records.publish_progress(3, 30, 80, 1.0, ready=True, sha256="ab" * 32)
    records.offer_state(SimpleNamespace(outer_step=4, sha256="cd" * 32))
    records.start()
    progress = lambda: [v for k, v in dht.stored if k == schema.progress_key("swarm-tiny")]  # noqa: E731
    while not progress():
        threading.Event().wait(0.01)
    records.close()
    assert dht.stored[0][0] == schema.commits_key("swarm-tiny")
    last = progress()[-1]
    assert (last["round"], last["sha256"], last["ready"], last["inner_step"]) == (4, "cd" * 32, False, 30)
    assert not records.announced_ready(3) and not records.announced_ready(4)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ahead", ["certified", "sybils"])
def test_a_round_is_over_once_the_swarm_certified_an_outer_step_past_ours(ahead):
    """Three groupmates committed outer step 4 while we took the state of step 3: our round is over at once (its
    exchange finds us behind and takes the state), not after H inner steps nobody would average. Eight fresh keys
    claiming step 4 without certificates end nobody's round: one identity one vote says behind, the certified
    reading does not."""
    from hivemind.utils import get_dht_time

    from swarm.net.ledger import Ledger

    h = {s: f"{s:x}".rjust(64, "0") for s in range(6)}
    mates = ["p", "q", "r"]
    statement = lambda s, who: schema.Statement(round=s, parent=h[s - 1], sha256=h[s], group=f"{s:02x}",  # noqa: E731
                                                size=len(who))

    def record(peer, step, sha, st=None):
        return schema.ProgressRecord(peer_id=peer, name=peer, round=step, inner_step=0, samples=0, samples_per_s=0.0,
                                     time=get_dht_time() - 0.5, serves_state=True, sha256=sha, statement=st)

    ledger = Ledger()
    ledger.found(["me", *mates])
    for s in range(4):
        ledger.hold(s, h[s])
    history = {p: [statement(s, mates) for s in range(1, 5)] for p in mates}
    commits = {p: schema.CommitRecord(name=p, round=4, sha256=h[4], time=get_dht_time() - 1, statements=st)
               for p, st in history.items()}
    if ahead == "certified":
        others = {p: record(p, 4, h[4], history[p][-1]) for p in mates}
    else:
        others = {**{p: record(p, 3, h[3], history[p][2]) for p in mates},
                  **{f"sybil{i}": record(f"sybil{i}", 4, "e" * 64) for i in range(8)}}
        commits = {p: c.copy(update={"round": 3, "sha256": h[3], "statements": c.statements[:3]})
                   for p, c in commits.items()}
    records = Records(SwarmConfig(request_timeout=600.0, progress_interval=600.0), _SilentDHT(), "me", "peer-0",
                      b"o", Access(), Hooks(), SimpleNamespace(snapshot=None), ledger=ledger)
    records.publish_progress(3, 31, 8, 1.0, sha256=h[3])
    mine = record("me", 3, h[3])
    records.read = lambda key, model: ({**others, "me": mine} if model is schema.ProgressRecord else commits)
    assert records.round_over(3) is (ahead == "certified")
