"""Signed records and private swarms: nobody writes in another peer's name, strangers are refused."""

import time

import pytest
from conftest import fast_cfg, three_dhts
from hivemind.utils.timed_storage import get_dht_time

from swarm.errors import SwarmError, UsageError
from swarm.net import schema
from swarm.net.dht import start_dht
from swarm.net.identity import load_identity, owner_peer_id, with_work
from swarm.net.policy import run_fingerprint

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)


def _progress(peer_id: str, name: str, round: int = 3) -> dict:
    return schema.ProgressRecord(peer_id=peer_id, name=name, round=round, inner_step=0, samples=0,
                                 samples_per_s=0.0, time=get_dht_time(), serves_state=True, ready=True).dict()


def _read(dht, run_id="swarm-tiny"):
    return schema.read_owned(dht.get(schema.progress_key(run_id), latest=True), schema.ProgressRecord, get_dht_time())


@pytest.mark.timeout(90)
def test_records_are_signed_by_their_owner_and_nobody_writes_for_another(bootstrap):
    honest, forger = load_identity(None), load_identity(None)
    honest_dht = start_dht(fast_cfg(initial_peers=bootstrap), honest)
    forger_dht = start_dht(fast_cfg(initial_peers=bootstrap), forger)
    try:
        key, expiration = schema.progress_key("swarm-tiny"), get_dht_time() + 30
        assert honest_dht.store(key, _progress(str(honest.peer_id), "honest"), subkey=honest.owner,
                                expiration_time=expiration)
        # The forger cannot sign under the honest peer's key: every node refuses the record.
        assert not forger_dht.store(key, _progress(str(honest.peer_id), "forged"), subkey=honest.owner,
                                    expiration_time=expiration + 1)
        # Nor write without an owner at all (the schema wants an owner marker subkey).
        assert not forger_dht.store(key, _progress(str(honest.peer_id), "forged"), subkey=str(honest.peer_id),
                                    expiration_time=expiration + 1)
        # Under its own key it may store a record naming the honest peer, but nobody believes it.
        assert forger_dht.store(key, _progress(str(honest.peer_id), "forged"), subkey=forger.owner,
                                expiration_time=expiration)
        records = _read(honest_dht)
        assert {p: r.name for p, r in records.items()} == {str(honest.peer_id): "honest"}
    finally:
        forger_dht.shutdown()
        honest_dht.shutdown()


@pytest.mark.timeout(90)
def test_a_private_swarm_refuses_a_strangers_dht_writes(bootstrap, tmp_path):
    members = [load_identity(str(tmp_path / f"m{i}.key")) for i in range(2)]
    allowed = [str(m.peer_id) for m in members]
    cfg = fast_cfg(initial_peers=bootstrap, run_id="private", auth="allowlist", allowed_peers=allowed)
    stranger = load_identity(None)
    with pytest.raises(UsageError, match="not in the allowlist"):
        start_dht(cfg, stranger)
    dhts = [start_dht(cfg, m) for m in members]
    # The stranger joins the DHT as an open peer (it cannot be kept out of Kademlia) and writes the run's keys.
    stranger_dht = start_dht(fast_cfg(initial_peers=bootstrap, run_id="private"), stranger)
    try:
        key, expiration = schema.progress_key("private"), get_dht_time() + 30
        assert dhts[0].store(key, _progress(allowed[0], "m0"), subkey=members[0].owner, expiration_time=expiration)
        stranger_dht.store(key, _progress(str(stranger.peer_id), "stranger"), subkey=stranger.owner,
                           expiration_time=expiration)
        time.sleep(0.5)
        assert {r.name for r in _read(dhts[1], "private").values()} == {"m0"}
    finally:
        stranger_dht.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_the_run_fingerprint_is_what_most_peers_signed():
    record = lambda fp, t: schema.RunRecord(fingerprint=fp, time=t)  # noqa: E731
    assert run_fingerprint({}) is None
    assert run_fingerprint({"a": record("x", 5.0), "b": record("x", 6.0), "evil": record("y", 1.0)}) == "x"
    assert run_fingerprint({"a": record("x", 5.0), "b": record("y", 6.0)}) == "x"  # a tie: signed first


@pytest.mark.timeout(90)
def test_a_stranger_cannot_replace_the_run_fingerprint(bootstrap):
    first = start_dht(fast_cfg(initial_peers=bootstrap), fingerprint="aaaa")
    second = start_dht(fast_cfg(initial_peers=bootstrap), fingerprint="aaaa")
    try:
        evil = load_identity(None)
        evil_dht = start_dht(fast_cfg(initial_peers=bootstrap), evil)
        now = get_dht_time()
        evil_dht.store(schema.run_key("swarm-tiny"), schema.RunRecord(fingerprint="bbbb", time=now - 1e6).dict(),
                       subkey=evil.owner, expiration_time=now + 1e5)
        evil_dht.shutdown()
        start_dht(fast_cfg(initial_peers=bootstrap), fingerprint="aaaa").shutdown()  # still joins
        with pytest.raises(SwarmError, match="fingerprint bbbb, the run.s peers signed aaaa"):
            start_dht(fast_cfg(initial_peers=bootstrap), fingerprint="bbbb")
    finally:
        second.shutdown()
        first.shutdown()


@pytest.mark.timeout(120)
def test_sybil_identities_outvote_the_run_for_a_newcomer_unless_each_vote_costs_work(bootstrap):
    """The `sybil` attack (hostile.py) through real DHT nodes: 3 minted identities sign a forged fingerprint and
    manifest (outer.lr x 10). In an open run without identity_work a newcomer refuses to join (its own, honest
    fingerprint is outvoted) and the manifest read is the forged one; in a run with identity_work the same free
    identities are not counted and the newcomer joins."""
    from dataclasses import replace

    from swarm.config import Config, shared_config
    from swarm.net.hostile import sybil_attack
    from swarm.net.manifest import choose_manifest, publish, read_manifests
    from swarm.run.runid import RunIdentity

    evil_dht = start_dht(fast_cfg(initial_peers=bootstrap))
    try:
        for run_id, bits in (("open-run", 0), ("paid-run", 8)):
            cfg = Config(swarm=fast_cfg(initial_peers=bootstrap, run_id=run_id, identity_work=bits))
            honest, run = with_work(load_identity(None), bits), RunIdentity(shared_config(cfg), "c" * 64)
            honest_dht = start_dht(cfg.swarm, honest, run=run)
            try:
                publish(honest_dht, cfg, run, honest, params=1)
                done = sybil_attack(evil_dht, replace(cfg.swarm, identity_work=0), budget_s=30, count=3)
                assert done["identities"] == 3
                fingerprint, manifests = read_manifests(honest_dht, run_id, 5.0, bits)
                chosen = choose_manifest(run_id, manifests, fingerprint).config
                if bits == 0:
                    assert fingerprint == done["fingerprint"] and chosen.outer.lr == 10 * cfg.outer.lr
                    with pytest.raises(SwarmError, match="refusing to join run 'open-run'"):
                        start_dht(cfg.swarm, run=run)
                else:
                    assert fingerprint == run.fingerprint and chosen.outer.lr == cfg.outer.lr
                    start_dht(cfg.swarm, run=run).shutdown()  # joins
            finally:
                honest_dht.shutdown()
    finally:
        evil_dht.shutdown()


def test_identity_files_bad_input(tmp_path):
    (tmp_path / "garbage").write_bytes(b"\x00\xffnot a key")
    with pytest.raises(UsageError, match="not a libp2p private key file"):
        load_identity(str(tmp_path / "garbage"))
    with pytest.raises(UsageError, match="cannot create the key file"):
        load_identity(str(tmp_path / "no-such-dir" / "id.key"))
    from hivemind.proto import crypto_pb2
    (tmp_path / "ed25519").write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                                             data=b"\x01" * 64).SerializeToString())
    with pytest.raises(UsageError, match="holds a Ed25519 key"):
        load_identity(str(tmp_path / "ed25519"))
    me = load_identity(str(tmp_path / "me.key"))
    assert owner_peer_id(me.owner) == str(me.peer_id) == str(load_identity(str(tmp_path / "me.key")).peer_id)
    assert owner_peer_id(b"[owner:ssh-rsa garbage]") is None and owner_peer_id("text") is None


async def _hello(p2p, owner, group_id: bytes, late: float = 0.0) -> str:
    """Open an all-reduce stream to `owner` naming `group_id` (the HELLO `late` s after the stream opened); what it
    answers (a FAIL's reason)."""
    import asyncio

    from swarm.net.wire import Channel, Kind, PeerFailed

    channel = await Channel.open(p2p, owner, "ar", 10.0)
    try:
        await asyncio.sleep(late)
        await channel.send_control(Kind.HELLO, {"group": group_id, "weight": 1.0})
        await channel.recv(4096)
        return "served"
    except PeerFailed as e:
        return str(e)
    finally:
        channel.close()


def _with_owner(dhts, stall: float, access, check) -> None:
    """An AllReduce service on dhts[0] (with `access`), and `check(p2ps)` run against it."""
    import asyncio
    import concurrent.futures

    from swarm.net.allreduce import AllReduce

    async def main():
        p2ps = [await d.replicate_p2p() for d in dhts]
        pool = concurrent.futures.ThreadPoolExecutor(1)
        service = AllReduce(p2ps[0], "ar", stall, 1e6, pool, access=access)
        await service.start()
        try:
            await check(p2ps)
        finally:
            await service.stop()
            for p2p in p2ps:
                await p2p.shutdown()
            pool.shutdown()
    asyncio.run(main())


@pytest.mark.timeout(90)
def test_a_private_swarm_refuses_a_strangers_averaging_streams():
    """A stranger opening an all-reduce stream to an allowlisted peer is failed at once; a member of the
    allowlist is served (it waits for the group, which never comes here)."""
    import asyncio

    from swarm.net.access import Access

    async def check(p2ps):
        owner = p2ps[0].peer_id
        stranger, member = await asyncio.gather(_hello(p2ps[2], owner, b"g" * 16), _hello(p2ps[1], owner, b"g" * 16))
        assert "not in this run's allowlist" in stranger
        assert "never started here" in member
        # refused before its HELLO is written (a loaded machine): it still reads why, its HELLO does not fail
        assert "not in this run's allowlist" in await _hello(p2ps[2], owner, b"h" * 16, late=0.5)
    with three_dhts() as dhts:
        _with_owner(dhts, 2.0, Access(frozenset({str(dhts[1].peer_id)})), check)


@pytest.mark.timeout(90)
def test_one_peer_cannot_fill_the_pending_groups_of_another():
    """A flood of streams naming made-up groups from one peer takes at most MAX_PENDING_PER_PEER slots."""
    import asyncio

    from swarm.net.allreduce import slots

    async def check(p2ps):
        answers = await asyncio.gather(*[_hello(p2ps[1], p2ps[0].peer_id, bytes([i]) * 16) for i in range(8)])
        assert sum("too many unknown groups pending" in a for a in answers) == 8 - slots.MAX_PENDING_PER_PEER
    with three_dhts() as dhts:
        _with_owner(dhts[:2], 3.0, None, check)
