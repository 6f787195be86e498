"""Manifests and the run index in a real DHT: who stores a copy, how many, and forgeries refused."""

import pytest
from hivemind.utils.timed_storage import get_dht_time

from swarm.errors import SwarmError
from swarm.net import schema
from swarm.net.dht import start_dht
from swarm.net.identity import load_identity
from swarm.net.manifest import fetch_manifest, publish, read_index, read_manifests, shared_config
from swarm.run.runid import RunIdentity
from tests.conftest import tiny_config

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)

CORPUS = "c0ffee"  # a corpus hash: nothing trains here


def run_of(cfg) -> RunIdentity:
    return RunIdentity(shared_config(cfg), CORPUS)


@pytest.mark.timeout(120)
def test_peers_store_copies_of_the_manifest_and_a_peer_of_another_run_is_refused_naming_the_key(bootstrap):
    swarm = {"run_id": "pub-run", "initial_peers": bootstrap, "bootstrap_timeout": 10.0}
    cfg = tiny_config(swarm=swarm)
    run = run_of(cfg)
    ids = {name: load_identity(None) for name in ("a", "b", "c", "d", "forger")}
    peer = {name: str(identity.peer_id) for name, identity in ids.items()}
    dhts = {}
    try:
        for name in "abcd":
            dhts[name] = start_dht(cfg.swarm, ids[name], run=run)
            publish(dhts[name], cfg, run, ids[name], params=123)
            if name == "a":
                publish(dhts["a"], cfg, run, ids["a"], params=123)  # again: no second copy, no second entry
        fingerprint, manifests = read_manifests(dhts["a"], "pub-run", 10.0)
        # a creates, b, c and d re-store a's manifest (the creator named is a): MANIFEST_COPIES (4)
        assert fingerprint == run.fingerprint
        assert set(manifests) == {peer[n] for n in "abcd"}
        assert {m.creator for m in manifests.values()} == {peer["a"]}
        assert all(m.config == shared_config(cfg) and m.corpus_sha256 == CORPUS for m in manifests.values())
        # index entries: a, b, c, then INDEX_COPIES (3) are enough
        index = read_index(dhts["a"], 10.0)
        assert set(index["pub-run"]) == {peer["a"], peer["b"], peer["c"]}
        assert {e.params for e in index["pub-run"].values()} == {123}

        # a peer with any other run setting is refused with one line naming what differs (the corpus and the
        # weights too: tests/test_runid.py)
        fragments = tiny_config(swarm=swarm, diloco={"fragments": 2})
        with pytest.raises(SwarmError, match="refusing to join run 'pub-run': diloco.fragments is 2 here but 1 in "
                                             "the run"):
            start_dht(fragments.swarm, load_identity(None), run=run_of(fragments))

        dhts["forger"] = start_dht(cfg.swarm, ids["forger"])
        now = get_dht_time()
        other_lr = tiny_config(swarm=swarm, inner={"lr": 0.5})
        forged = schema.ManifestRecord(config=shared_config(other_lr), fingerprint=run.fingerprint,
                                       creator=peer["forger"], time=now, version=schema.MANIFEST_VERSION,
                                       corpus_sha256=CORPUS).dict()
        # under a's key: no node takes a record it cannot verify
        assert not dhts["forger"].store(schema.manifest_key("pub-run"), forged, subkey=ids["a"].owner,
                                        expiration_time=now + 600)
        # under its own key it claims the run's fingerprint, but its config does not reproduce it
        assert dhts["forger"].store(schema.manifest_key("pub-run"), forged, subkey=ids["forger"].owner,
                                    expiration_time=now + 600)
        choice = fetch_manifest(dhts["d"], "pub-run", bootstrap, 10.0)
        assert choice.config.inner.lr == cfg.inner.lr and choice.signers == sorted(peer[n] for n in "abcd")
    finally:
        for dht in dhts.values():
            dht.shutdown()


@pytest.mark.timeout(60)
def test_a_private_run_is_not_advertised_and_an_oversized_manifest_is_not_published(bootstrap, caplog):
    member = load_identity(None)
    swarm = {"run_id": "private-run", "initial_peers": bootstrap, "bootstrap_timeout": 10.0, "auth": "allowlist"}
    cfg = tiny_config(swarm={**swarm, "allowed_peers": [str(member.peer_id)]})
    dht = start_dht(cfg.swarm, member, run=run_of(cfg))
    try:
        publish(dht, cfg, run_of(cfg), member, params=1)
        assert set(read_manifests(dht, "private-run", 10.0)[1]) == {str(member.peer_id)}  # joinable by members
        assert "private-run" not in read_index(dht, 10.0)  # but not advertised
        big = tiny_config(swarm={**swarm, "run_id": "big-run", "allowed_peers": [str(member.peer_id)] * 400})
        publish(dht, big, run_of(big), member, params=1)
        assert "the manifest of run 'big-run' is not published: config is" in caplog.text
        assert read_manifests(dht, "big-run", 10.0)[1] == {}
        now = get_dht_time()  # a run whose peers signed a fingerprint but stored no manifest (an older swarm)
        assert dht.store(schema.run_key("bare-run"), schema.RunRecord(fingerprint="abc", time=now).dict(),
                         subkey=member.owner, expiration_time=now + 600)
        with pytest.raises(SwarmError, match="no manifest of run 'bare-run' .* signed fingerprint abc but stored no"):
            fetch_manifest(dht, "bare-run", bootstrap, 3.0)
    finally:
        dht.shutdown()
