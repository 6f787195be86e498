"""The trainer never waits on the DHT: its progress records and commit records are stored by the heartbeat
thread, which does not wait for the DHT's answers either (swarm/net/records.py)."""

import concurrent.futures
import gc
import threading
import weakref
from types import SimpleNamespace

import pytest

from swarm.averaging import PeerStats
from swarm.config import SwarmConfig
from swarm.net import schema
from swarm.net.hostile import Hooks
from swarm.net.peer import SwarmAverager


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


def _averager(dht) -> SwarmAverager:
    averager = object.__new__(SwarmAverager)
    vars(averager).update(cfg=SwarmConfig(request_timeout=600.0, progress_interval=600.0), peer_id="me",
                          peer_name="peer-0", _owner=b"o", _dht_lock=threading.Lock(), dht=dht, hooks=Hooks(),
                          _server=SimpleNamespace(snapshot=None), _stats=PeerStats(), _last_progress=None,
                          _published=None, _committed="", _commit_lock=threading.Lock(), _offered=None,
                          _pending_commit=None, _progress_due=threading.Event(), _stopping=threading.Event(),
                          _storing=set())
    return averager


@pytest.mark.timeout(30)
def test_the_trainer_and_the_heartbeat_never_wait_for_the_dht():
    """With a DHT that never confirms a store (request_timeout 600 s), publishing progress and offering a
    state return at once, and the heartbeat stores the commit record, then the progress record, and goes on:
    a second publish is stored too. The state is served only once its commit record is confirmed."""
    dht = _SilentDHT()
    averager = _averager(dht)
    beat = threading.Thread(target=averager._heartbeat, daemon=True)
    beat.start()
    snapshot = SimpleNamespace(round=3, sha256="ab" * 32)
    averager.offer_state(snapshot)
    averager.publish_progress(3, 7, 56, 1.0, ready=True, sha256="ab" * 32)
    stored_steps = lambda: [value["inner_step"] for key, value in dht.stored if "inner_step" in value]  # noqa: E731
    while 7 not in stored_steps():
        threading.Event().wait(0.01)
    averager.publish_progress(3, 9, 72, 1.0, ready=True, sha256="ab" * 32)
    while 9 not in stored_steps():
        threading.Event().wait(0.01)
    averager._stopping.set()
    averager._progress_due.set()
    beat.join(10)
    assert not beat.is_alive()
    keys = [key for key, _ in dht.stored]
    assert keys[0] == schema.commits_key("swarm-tiny") and set(keys[1:]) == {schema.progress_key("swarm-tiny")}
    assert stored_steps() == sorted(stored_steps()) and stored_steps()[-1] == 9
    assert averager._server.snapshot is None  # its commit record never confirmed: not served yet


@pytest.mark.timeout(30)
def test_a_state_is_served_once_its_commit_record_is_confirmed_later():
    """The heartbeat does not wait for the commit record's store; when the DHT answers later, the peer serves
    the state (hivemind answers only futures someone still holds: the peer keeps them until answered)."""
    dht = _LateDHT()
    averager = _averager(dht)
    snapshot = SimpleNamespace(round=3, sha256="ab" * 32)
    averager.offer_state(snapshot)
    averager._flush_commit(wait=False)
    gc.collect()
    assert averager._server.snapshot is None
    dht.answer()
    assert averager._server.snapshot is snapshot and not averager._storing
