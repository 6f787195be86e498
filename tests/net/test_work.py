"""Identities that cost something (`swarm.identity_work`, swarm/net/work.py): a peer id counts only with a proof of
work on its key, wherever it votes (fingerprint, manifest copies, progress and commit records) or takes a seat in a
group; and what the `sybil` attack's votes cost with and without it. Records are read as `dht.get` returns them."""

import time

from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration

from swarm.config import Config, shared_config
from swarm.net import grouping, schema, work
from swarm.net.access import Access
from swarm.net.identity import load_identity, with_work
from swarm.net.manifest import choose_manifest
from swarm.net.matchmaking import Group
from swarm.net.policy import run_fingerprint
from swarm.net.sybil import forged_run, mint
from swarm.run.runid import RunIdentity

BITS = 8  # 256 hashes expected: a test's worth


def _found(records: dict[bytes, dict]) -> ValueWithExpiration:
    now = time.time()
    return ValueWithExpiration({owner: ValueWithExpiration(value, now + 60) for owner, value in records.items()},
                               now + 60)


def test_a_proof_of_work_is_found_once_kept_beside_the_key_and_checked_with_one_hash(tmp_path):
    key_file = tmp_path / "peer.key"
    while work.proves(work.public_key(load_identity(str(key_file)).owner), 0, BITS):
        key_file.unlink()  # a key whose nonce 0 proves the work already (1 in 2^BITS): nothing to search or keep
    key_file = str(key_file)
    identity = with_work(load_identity(key_file), BITS)
    assert work.proves(work.public_key(identity.owner), identity.work, BITS)
    assert not work.proves(work.public_key(identity.owner), identity.work, 64)  # 2^64: not by chance
    assert (tmp_path / "peer.key.work").exists()
    again = with_work(load_identity(key_file), BITS)
    assert again.work == identity.work  # read back, not searched again
    assert work.proves(b"any key", 0, 0)  # identity_work 0: every id counts


def test_votes_of_identities_without_work_are_not_counted():
    """The `sybil` attack on the fingerprint: 2 fresh identities sign a forged fingerprint against 1 honest peer.
    Without identity_work the forged one is the run's; with it, only the honest votes count, until the sybil
    does the work for each identity (then it wins again: the work is a price per vote, not a wall)."""
    honest = [with_work(load_identity(None), BITS)]
    free, _ = mint(2, 0, budget_s=60)
    paid, seconds = mint(2, BITS, budget_s=60)
    now = time.time()

    def votes(sybils) -> ValueWithExpiration:
        records = {h.owner: schema.RunRecord(fingerprint="honest", time=now, work=h.work).dict() for h in honest}
        records |= {s.owner: schema.RunRecord(fingerprint="forged", time=now, work=s.work).dict() for s in sybils}
        return _found(records)
    assert run_fingerprint(schema.read_owned(votes(free), schema.RunRecord, now)) == "forged"
    assert run_fingerprint(schema.read_owned(votes(free), schema.RunRecord, now, BITS)) == "honest"
    assert run_fingerprint(schema.read_owned(votes(paid), schema.RunRecord, now, BITS)) == "forged"
    assert all(work.proves(work.public_key(s.owner), s.work, BITS) for s in paid) and seconds > 0


def test_a_manifest_copy_counts_only_from_a_proven_signer():
    cfg = Config()
    corpus = "c" * 64
    shared, fingerprint = shared_config(cfg), RunIdentity(shared_config(cfg), corpus).fingerprint
    forged, forged_fp = forged_run(shared, corpus)
    honest = with_work(load_identity(None), BITS)
    sybils, _ = mint(2, 0, budget_s=60)
    now = time.time()

    def manifest(config, fp, signer_work):
        return schema.ManifestRecord(config=config, fingerprint=fp, creator="c", time=now, corpus_sha256=corpus,
                                     version=schema.MANIFEST_VERSION, work=signer_work).dict()
    found = _found({honest.owner: manifest(shared, fingerprint, honest.work)}
                   | {s.owner: manifest(forged, forged_fp, 0) for s in sybils})
    for bits, expected in ((0, forged_fp), (BITS, fingerprint)):
        manifests = schema.read_owned(found, schema.ManifestRecord, now, bits)
        runs = {p: schema.RunRecord(fingerprint=m.fingerprint, time=now) for p, m in manifests.items()}
        assert choose_manifest(cfg.swarm.run_id, manifests, run_fingerprint(runs)).record.fingerprint == expected


def test_a_group_member_without_proven_identity_is_left_out():
    ids = [PeerID(bytes([0, 1, i])) for i in range(3)]
    access = Access()
    offenses = grouping.Offenses(access)
    group = Group(b"g" * 16, ids, [{} for _ in ids])
    assert offenses.exclude(group, 0) == (group, frozenset())  # identity_work 0: nobody's proof is asked for
    access.prove({str(ids[0]), str(ids[1])})
    kept, dropped = offenses.exclude(group, 0)
    assert kept.members == ids[:2] and kept.group_id != group.group_id and dropped == {str(ids[2])}
    assert [e["event"] for e in access.events] == ["unproven"] and access.events[0]["peer_id"] == str(ids[2])
