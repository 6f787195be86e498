"""Clients (`swarm.client_mode`: peers that cannot be dialed) in a group: they own no part, nobody dials them,
and they end with the same average as everyone else. The real thing behind a NAT: test_nat.py."""

import concurrent.futures
from types import SimpleNamespace

import pytest
import torch
from conftest import run_group, three_dhts
from hivemind.p2p import PeerID

from swarm.config import SwarmConfig
from swarm.net import grouping, schema
from swarm.net.access import Access
from swarm.net.allreduce import agree
from swarm.net.allreduce.groupstate import AllReduceFailed
from swarm.net.allreduce.layout import WireLayout
from swarm.net.codec import get_codec
from swarm.net.hostile import Hooks
from swarm.net.matchmaking import Group, GroupMeta, fits, misfit
from swarm.net.peer import SwarmAverager
from swarm.net.records import Records


def peer(i: int) -> PeerID:
    return PeerID(bytes([0, 1, i]))


def test_parts_go_to_the_owners_in_member_order_and_a_client_owns_nothing():
    layout = WireLayout([torch.Size([10])], get_codec("none"), 3, clients={1})
    assert layout.owners == [0, 2]
    assert layout.parts == [(0, 5), (10, 10), (5, 10)]
    assert layout.chunks(1) == [] and [c.numel for c in layout.chunks(0) + layout.chunks(2)] == [5, 5]
    assert [layout.part_wire_bytes(j) for j in range(3)] == [20, 0, 20]  # fp32: 4 bytes an element
    # an owner sends its contribution to the other owner's part, and its own part's average to 2 groupmates;
    # the client sends its contributions to both parts (and receives as much)
    assert [layout.member_wire_bytes(j) for j in range(3)] == [20 + 2 * 20, 20 + 20, 20 + 2 * 20]


def test_without_clients_the_layout_is_as_before():
    assert WireLayout([torch.Size([10])], get_codec("none"), 3).parts == [(0, 4), (4, 7), (7, 10)]
    assert WireLayout([torch.Size([10])], get_codec("none"), 3, clients=()).owners == [0, 1, 2]


def test_a_group_of_clients_only_has_nobody_to_own_a_part():
    with pytest.raises(ValueError, match="all 2 members are clients"):
        WireLayout([torch.Size([10])], get_codec("none"), 2, clients={0, 1})
    with pytest.raises(ValueError, match="not all among"):
        WireLayout([torch.Size([10])], get_codec("none"), 2, clients={2})
    clients_only = Group(b"g" * 16, [peer(0), peer(1)], [{"client": True}, {"client": True}])
    with pytest.raises(AllReduceFailed, match="all 2 members of the group are clients"):
        grouping.clients(clients_only)


def test_clients_come_from_the_metas_and_are_never_dialed():
    g = Group(b"g" * 16, [peer(i) for i in range(4)],
              [{"client": False}, {"client": True}, {}, {"client": "yes"}])  # only a real True counts
    assert grouping.clients(g) == [1]
    assert grouping.dialable(g) == [peer(0), peer(2), peer(3)]


def test_the_client_flag_in_matchmaking_metadata_is_a_strict_bool():
    meta = dict(round=0, nonce="0" * 16, token=2.0)
    assert GroupMeta.parse_obj(meta).client is False
    assert fits(dict(meta, client=True)) and not fits(dict(meta, client=1)) and not fits(dict(meta, client="true"))


def test_a_client_meta_fits_a_group_and_misfits_are_named():
    metas = {"a": GroupMeta(round=4, nonce="0" * 16, token=2.0),
             "b": GroupMeta(round=4, nonce="1" * 16, token=2.0, client=True)}
    assert misfit(4, metas, metas["a"]) is None  # audits reach a client on the stream it opens (audit.offer)
    assert misfit(5, metas, metas["a"]) == ("outer step 5: a, b sent metadata of another outer step", [])  # a replay?
    assert misfit(3, metas, metas["a"])[1] == ["a", "b"]  # a later round's meta: only its member signed it
    other = dict(metas, c=GroupMeta(round=4, nonce="2" * 16, token=2.0, numel=7))
    assert misfit(4, other, metas["a"])[1] == ["c"]  # the one whose signed size differs


@pytest.mark.slow  # starts peers
@pytest.mark.timeout(60)
def test_a_client_takes_part_owns_nothing_and_ends_with_the_same_average():
    """Member 1 is a client. Its AllReduce never registers its stream handlers, so a stream opened to it
    would fail the run: that every member completes proves nobody dialed it."""
    calls = []

    async def deaf() -> None:
        calls.append("start")

    async def gone() -> None:
        calls.append("stop")

    vectors, weights = [torch.randn(5_000) for _ in range(3)], [1.0, 2.0, 1.0]
    with three_dhts() as dhts:
        members, results = run_group(dhts, vectors, weights, clients=(1,), chunk_elements=1024,
                                     hooks={1: {"start": deaf, "stop": gone}})
    assert calls == ["start", "stop"]
    expected = (vectors[0] + 2 * vectors[1] + vectors[2]) / 4
    for r in results:
        assert not isinstance(r, BaseException), r
        assert torch.equal(r.tensor, results[0].tensor)
        assert torch.allclose(r.tensor, expected, atol=1e-6)
    # owners own 2500 elements each: the client sends 2 x 10 kB and receives as much, nothing else but the
    # agreement's digests (allreduce/agree.py)
    layout = WireLayout([torch.Size([5_000])], get_codec("none"), 3, 1024, clients={1})
    assert layout.member_wire_bytes(1) == 2 * 2_500 * 4
    client, owner = results[1].traffic, results[0].traffic
    assert 2 * 2_500 * 4 <= client.sent < 2 * 2_500 * 4 * 1.05 + agree.wire_bytes(3)
    assert client.received >= 2 * 2_500 * 4
    assert owner.sent >= layout.member_wire_bytes(0)


async def _deaf() -> None:
    """A client's AllReduce registers no stream handler (peer.py): a stream opened to it fails. Its stop, too."""


@pytest.mark.slow  # starts peers
@pytest.mark.timeout(60)
def test_an_audited_group_with_a_client_agrees_on_the_average():
    from swarm.net.allreduce.robust import Rule

    vectors = [torch.randn(5_000) for _ in range(3)]
    with three_dhts() as dhts:
        _, results = run_group(dhts, vectors, [1.0, 1.0, 1.0], clients=(2,), rule=Rule(verify=True),
                               chunk_elements=1024, hooks={2: {"start": _deaf, "stop": _deaf}})
    for r in results:
        assert not isinstance(r, BaseException), r
        assert torch.equal(r.tensor, results[0].tensor)
    assert torch.allclose(results[0].tensor, torch.stack(vectors).mean(0), atol=1e-6)


@pytest.mark.slow  # starts peers
@pytest.mark.timeout(60)
def test_an_owner_lying_to_a_group_with_a_client_is_named_by_every_auditor():
    """Owner 0 adds 1e-3 to its part's average. Owner 1 can recompute that part only with the client's
    contribution, which the client brings on a stream it opens (it cannot be dialed); the client recomputes it
    from the two owners. Each names owner 0 itself, and nobody returns the wrong average."""
    from swarm.net.allreduce.robust import Rule
    from swarm.net.hostile import Hooks

    class Lies(Hooks):
        def average(self, values, chunk):
            return values + 1e-3

    with three_dhts() as dhts:
        members, results = run_group(dhts, [torch.randn(3000) for _ in range(3)], [1.0, 1.0, 1.0], clients=(2,),
                                     rule=Rule(verify=True), stall=5.0,
                                     hooks={0: {"hooks": Lies()}, 2: {"start": _deaf, "stop": _deaf}})
    for r in results[1:]:  # the liar's own outcome is its business (it may finish before a FAIL reaches it)
        assert f"owner {members[0]} returned a wrong average" in str(r) and r.culprit == members[0], results


class _DHT:
    def __init__(self):
        self.stored = []

    def store(self, key, value, subkey, expiration_time, return_future):
        self.stored.append((key, value))
        done = concurrent.futures.Future()
        done.set_result(True)
        return done


@pytest.mark.parametrize("client", [True, False])
def test_a_client_records_its_commits_but_never_serves_its_state(client):
    """offer_state returns at once; the commit is recorded (by the heartbeat, or before the last progress
    record at the latest), and only then served, by a peer that is not a client."""
    published = []
    cfg, dht = SwarmConfig(client_mode=client, linger_time=0.0), _DHT()
    records = Records(cfg, dht, "me", "home", b"o", Access(), Hooks(), SimpleNamespace(snapshot=None))
    averager = object.__new__(SwarmAverager)  # its records and a stand-in for its publish_progress, no network
    vars(averager).update(cfg=cfg, peer_id="me", records=records,
                          publish_progress=lambda *a, **k: published.append(k["sha256"]))
    snapshot = SimpleNamespace(outer_step=2, sha256="ab" * 32)
    averager.offer_state(snapshot)
    assert dht.stored == [] and records.serving is None and records.commit_pending
    averager.finish(2, "ab" * 32)
    assert [(key, value["round"], value["sha256"]) for key, value in dht.stored] == [
        (schema.commits_key(cfg.run_id), 2, "ab" * 32)]
    assert records.serving is (None if client else snapshot)  # `serves_state` is this, not None
    assert published == ["ab" * 32]  # its final record names the hash it committed


@pytest.mark.slow  # starts peers
@pytest.mark.timeout(60)
def test_a_client_that_brings_no_contributions_leaves_its_parts_unchecked_not_the_group_stalled(monkeypatch):
    """A client that never opens its audit stream (an older peer, or one that will not be checked): each owner
    waits for it until the client's DONE and `stall` s more, then audits without it (that part unchecked): had
    it waited on, the run's deadline would have failed the group."""
    from swarm.net.allreduce import audit
    from swarm.net.allreduce.robust import Rule

    async def silent(slots, group, m) -> None:
        return None
    monkeypatch.setattr(audit, "offer", silent)
    with three_dhts() as dhts:
        _, results = run_group(dhts, [torch.randn(3000) for _ in range(3)], [1.0, 1.0, 1.0], clients=(2,),
                               rule=Rule(verify=True), stall=2.0, hooks={2: {"start": _deaf, "stop": _deaf}})
    assert all(not isinstance(r, BaseException) for r in results), results
