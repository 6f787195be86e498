"""The corpus fetch's pure parts (swarm/net/corpussync.py): a donor's manifest checked for shape, pieces kept
across a restart, and the whole checked against the run's corpus hash before it is put in place."""

import asyncio
import concurrent.futures
import hashlib
import os
import shutil

import pytest
from loopback_p2p import LoopbackNet

from swarm.data.batches import load_corpus
from swarm.data.tokens import Prepared
from swarm.net.access import Access
from swarm.net.corpussync import (
    FILES,
    PIECE_BYTES,
    CorpusForged,
    CorpusRefused,
    CorpusServer,
    Fetch,
    Manifest,
    describe,
    fetch,
)
from swarm.net.wire import Channel, Kind, PeerFailed
from swarm.run.configfile import load_config


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared corpus of three pieces of train tokens (9.2 MB)."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "text").mkdir()
    (root / "text" / "part.txt").write_text("\n".join(f"{i} " + "abcdefgh" * 60 for i in range(10_000)))
    cfg = load_config(None, {"data": {"source": "hf", "dataset": str(root / "text"), "cache_dir": str(root / "a")}})
    return load_corpus(cfg.data, cache=False).prepared


def test_a_manifest_describes_the_prepared_files_and_reads_back(prepared):
    manifest = describe(prepared.folder)
    assert manifest.dtype == "uint16" and len(manifest.pieces["train.bin"]) == 3
    assert manifest.sizes == {name: (prepared.folder / name).stat().st_size for name in FILES}
    assert Manifest.parse(manifest.to_dict()) == manifest
    assert (prepared.folder / "pieces.json").exists() and describe(prepared.folder) == manifest  # kept, read back


def bad(manifest: Manifest, **change) -> dict:
    value = manifest.to_dict()
    for key, update in change.items():
        value[key] = update(value[key])
    return value


@pytest.mark.parametrize("change, why", [
    ({"format": lambda f: f + 1}, "another format"),
    ({"dtype": lambda d: "float64"}, "another format"),
    ({"sizes": lambda s: {"train.bin": s["train.bin"]}}, "does not name train.bin and eval.bin"),
    ({"sizes": lambda s: {**s, "train.bin": s["train.bin"] + 1}}, "train.bin size or piece hashes"),  # half a token
    ({"sizes": lambda s: {**s, "train.bin": s["train.bin"] + PIECE_BYTES}}, "train.bin size or piece hashes"),
    ({"pieces": lambda p: {**p, "eval.bin": [b"short"]}}, "eval.bin size or piece hashes"),
    ({"sizes": lambda s: {**s, "train.bin": 10**15}}, "train.bin size or piece hashes"),  # past MAX_PIECES
])
def test_a_malformed_manifest_is_refused(prepared, change, why):
    with pytest.raises(CorpusRefused, match=why):
        Manifest.parse(bad(describe(prepared.folder), **change))


def pieces(folder, manifest):
    for name in FILES:
        data = (folder / name).read_bytes()
        for i in range(len(manifest.pieces[name])):
            yield name, i, data[i * PIECE_BYTES:(i + 1) * PIECE_BYTES]


def test_fetched_pieces_survive_a_restart_and_the_whole_lands_where_a_peer_looks(prepared, tmp_path):
    manifest = describe(prepared.folder)
    target = tmp_path / "cache" / prepared.folder.name
    fetch = Fetch(target)
    fetch.begin(manifest)
    first = next(pieces(prepared.folder, manifest))
    fetch.write(*first)
    fetch.note()
    again = Fetch(target)  # killed and started again: the same manifest goes on from the piece it had
    again.begin(manifest)
    assert again.have == {first[:2]} and again.bytes_had() == len(first[2])
    other = Manifest(manifest.dtype, manifest.sizes, {**manifest.pieces, "eval.bin": [b"\0" * 32]})
    Fetch(target).begin(other)  # another donor's word for other pieces: starts over
    again = Fetch(target)
    again.begin(manifest)
    assert again.have == set()
    for name, i, data in pieces(prepared.folder, manifest):
        again.write(name, i, data)
    again.finish(prepared.meta["sha256"], "bytes", 256, 0, "donor")
    landed = Prepared(target)
    landed.check()
    assert landed.meta["sha256"] == prepared.meta["sha256"] and landed.meta["train_tokens"] == prepared.meta[
        "train_tokens"]
    assert (target / "train.bin").read_bytes() == (prepared.folder / "train.bin").read_bytes()


def test_pieces_that_add_up_to_another_corpus_are_dropped(prepared, tmp_path):
    manifest = describe(prepared.folder)
    target = tmp_path / "cache" / prepared.folder.name
    fetch = Fetch(target)
    fetch.begin(manifest)
    for name, i, data in pieces(prepared.folder, manifest):
        fetch.write(name, i, data)
    other = hashlib.sha256(b"another corpus").hexdigest()
    with pytest.raises(CorpusForged, match=f"the pieces donor sent hash to {prepared.meta['sha256'][:16]}, not the "
                                           f"run's corpus {other[:16]}"):
        fetch.finish(other, "bytes", 256, 0, "donor")
    assert not target.exists() and not fetch.work.exists()


def test_a_donor_whose_bytes_lie_is_left_and_an_honest_one_gives_the_corpus(prepared, tmp_path):
    """Over stand-in streams (loopback_p2p.py): a donor whose bytes differ from its piece hashes (changed in place,
    size and time kept, after it described them) is refused at its first piece; an honest donor then gives every
    piece, and the whole hashes to the run's corpus; a stream that asks for more than the corpus is cut; a
    peer the donor's Access refuses gets nothing."""
    liar_folder = shutil.copytree(prepared.folder, tmp_path / "liar")
    describe(liar_folder)  # its piece hashes kept (pieces.json), then its bytes changed behind them
    train = liar_folder / "train.bin"
    stat = train.stat()
    with open(train, "r+b") as f:
        f.write(b"\xff\xff")
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    async def main():
        net, pool = LoopbackNet(), concurrent.futures.ThreadPoolExecutor(2)
        servers = {}
        for name, folder in (("liar", liar_folder), ("honest", prepared.folder)):
            p2p = net.p2p()
            servers[name] = CorpusServer(p2p, "corpus", 5.0, pool, Access(), rate=1e9)
            servers[name].offer(folder)
            await servers[name].start()
        me = net.p2p()
        into = Fetch(tmp_path / "mine" / prepared.folder.name)
        with pytest.raises(CorpusRefused, match="piece 0 of train.bin from .* does not match its hash"):
            await fetch(me, servers["liar"].p2p.peer_id, "corpus", 5.0, 1e6, into, prepared.meta["sha256"],
                        lambda n: None)
        got = []
        await fetch(me, servers["honest"].p2p.peer_id, "corpus", 5.0, 1e6, into, prepared.meta["sha256"], got.append)
        into.finish(prepared.meta["sha256"], "bytes", 256, 0, "honest")
        assert sum(got) == sum((prepared.folder / n).stat().st_size for n in FILES)
        greedy = await Channel.open(me, servers["honest"].p2p.peer_id, "corpus", 5.0)
        await greedy.send_control(Kind.HELLO, {})
        manifest = Manifest.parse(await greedy.recv_control())
        with pytest.raises(PeerFailed, match="more than the whole corpus"):
            for _ in range(10):  # the same piece, again and again
                await greedy.send_control(Kind.HELLO, {"file": "train.bin", "piece": 0})
                for _ in range(PIECE_BYTES // (1 << 20)):
                    await greedy.recv(1 << 21)
        assert len(manifest.pieces["train.bin"]) == 3
        stranger = net.p2p()
        servers["honest"].access.banned.add(str(stranger.peer_id))
        with pytest.raises(PeerFailed, match="is banned"):
            await fetch(stranger, servers["honest"].p2p.peer_id, "corpus", 5.0, 1e6,
                        Fetch(tmp_path / "stranger" / "x"), prepared.meta["sha256"], lambda n: None)
        await net.close()
        pool.shutdown()
    asyncio.run(main())
    assert Prepared(tmp_path / "mine" / prepared.folder.name).meta["sha256"] == prepared.meta["sha256"]
