"""A peer without the run's corpus fetches its token files from the peers that train on it.

Every networked peer serves its prepared corpus (swarm/data/tokens.py: `train.bin`, `eval.bin`) on one stream name,
to the peers `Access` admits (a private swarm's allowlist), to at most MAX_SERVED fetchers at once and at most
`swarm.corpus_rate` bytes/s to each, so that serving data never takes an outer step's link. A fetcher (`swarm join` on
a machine without the corpus, peers/join.py) reads a MANIFEST: the dtype, the two files' sizes and the sha256 of
every PIECE_BYTES piece of each; then it asks for the pieces it lacks, one at a time (a HELLO `{"file", "piece"}`,
answered by DATA frames that together hold exactly that piece), checks each piece against its hash and writes
it in place under `<folder>.fetch/`, where `have.json` notes the pieces written: a fetcher killed mid-way goes on
where it stopped, with its memory bounded by one frame.

The piece hashes are the donor's word. After the last piece the two files must hash to the run's corpus sha256
(pinned by the run's fingerprint, swarm/run/runid.py), or all that donor's pieces are dropped and the next donor is
asked (`CorpusForged`). Then `meta.json` is written and the folder renamed into place, where `load_corpus` finds
it as if it had been prepared here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from hivemind.p2p import P2P, PeerID

from swarm.data.tokens import FORMAT, SPLITS, digest, write_stamp
from swarm.errors import SwarmError
from swarm.net.access import Access
from swarm.net.budget import transfer_deadline
from swarm.net.wire import Channel, Kind, ProtocolError, serve

logger = logging.getLogger(__name__)

PIECE_BYTES = 4 << 20  # one piece: hashed, fetched and noted as a unit
DATA_BYTES = 1 << 20  # one DATA frame
MAX_PIECES = 100_000  # 400 GB of tokens: a manifest that names more is refused (it must fit a control frame)
MAX_SERVED = 2  # fetchers one peer serves at once; more are told to ask another peer
FILES = tuple(f"{split}.bin" for split in SPLITS)


class CorpusRefused(SwarmError):
    """A donor's corpus manifest or pieces are not what the run needs."""


class CorpusForged(CorpusRefused):
    """Every piece matched the donor's hashes, but the files do not hash to the run's corpus sha256."""


@dataclass(frozen=True)
class Manifest:
    """What a donor says its corpus is: dtype, the files' sizes, the hash of each piece of each file."""

    dtype: str
    sizes: dict[str, int]
    pieces: dict[str, list[bytes]]

    def to_dict(self) -> dict:
        return {"format": FORMAT, "dtype": self.dtype, "sizes": self.sizes, "pieces": self.pieces}

    @classmethod
    def parse(cls, value: dict) -> Manifest:
        """A donor's MANIFEST, checked for shape (CorpusRefused otherwise); its hashes are checked later."""
        dtype, sizes, pieces = value.get("dtype"), value.get("sizes"), value.get("pieces")
        if value.get("format") != FORMAT or dtype not in ("uint16", "uint32"):
            raise CorpusRefused(f"a manifest of another format ({value.get('format')!r}, dtype {dtype!r})")
        if not (isinstance(sizes, dict) and isinstance(pieces, dict) and set(sizes) == set(pieces) == set(FILES)):
            raise CorpusRefused("a manifest that does not name train.bin and eval.bin")
        for name in FILES:
            size, hashes = sizes[name], pieces[name]
            if not (type(size) is int and 0 <= size <= MAX_PIECES * PIECE_BYTES and size % np.dtype(dtype).itemsize == 0
                    and isinstance(hashes, list) and len(hashes) == -(-size // PIECE_BYTES)
                    and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)):
                raise CorpusRefused(f"a manifest whose {name} size or piece hashes do not fit")
        return cls(dtype, dict(sizes), {k: list(v) for k, v in pieces.items()})


def describe(folder: Path) -> Manifest:
    """The manifest of the prepared corpus in `folder`: read from `pieces.json` if the token files kept their sizes
    and times since it was written, else made by reading every byte once (off the event loop) and kept there."""
    stamp = [[name, (folder / name).stat().st_size, (folder / name).stat().st_mtime_ns] for name in FILES]
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, CorpusRefused):
        kept = json.loads((folder / "pieces.json").read_text())
        if kept["stamp"] == stamp:
            return Manifest.parse(_unhex(kept["manifest"]))
    meta = json.loads((folder / "meta.json").read_text())
    sizes, pieces = {}, {}
    for name in FILES:
        sizes[name], pieces[name] = (folder / name).stat().st_size, []
        with open(folder / name, "rb") as f:
            while piece := f.read(PIECE_BYTES):
                pieces[name].append(hashlib.sha256(piece).digest())
    manifest = Manifest(meta["dtype"], sizes, pieces)
    try:
        (folder / "pieces.json").write_text(json.dumps({"stamp": stamp, "manifest": _hexed(manifest.to_dict())}))
    except OSError as e:  # a read-only corpus folder: read again at the next start
        logger.warning(f"cannot keep the corpus's piece hashes in {folder}: {e}")
    return manifest


class CorpusServer:
    """Serves the prepared corpus `offer`ed to it to admitted fetchers; each stream is given at most the corpus's
    size (a fetcher that asks for more holds a slot nobody else gets)."""

    def __init__(self, p2p: P2P, name: str, stall: float, pool: concurrent.futures.Executor, access: Access,
                 rate: float):
        self.p2p, self.name, self.stall, self.pool, self.access, self.rate = p2p, name, stall, pool, access, rate
        self.folder: Optional[Path] = None
        self._manifest: Optional[concurrent.futures.Future] = None  # of `folder`: its piece hashes, read once
        self._busy = 0

    def offer(self, folder: Path) -> None:
        """Serve the prepared corpus in `folder`; its piece hashes are computed now, in the background (one read of
        the token files), so that a fetcher does not wait for them."""
        self.folder, self._manifest = folder, self.pool.submit(describe, folder)

    async def start(self) -> None:
        await serve(self.p2p, self.name, self.stall, self._serve, self.access)

    async def stop(self) -> None:
        await self.p2p.remove_binary_stream_handler(self.name)

    async def _serve(self, channel: Channel) -> None:
        await channel.recv_control()
        if self._manifest is None:
            return await channel.refuse("no corpus to serve")
        if self._busy >= MAX_SERVED:
            return await channel.refuse(f"serving the corpus to {self._busy} peers already; ask another peer")
        self._busy += 1
        try:
            loop = asyncio.get_running_loop()
            manifest = await asyncio.wrap_future(self._manifest)
            await channel.send_control(Kind.MANIFEST, manifest.to_dict())
            left = sum(manifest.sizes.values())  # what this stream may still be sent
            while not (want := await channel.recv_control()).get("done"):
                name, piece = want.get("file"), want.get("piece")
                if name not in FILES or type(piece) is not int or not 0 <= piece < len(manifest.pieces[name]):
                    raise ProtocolError(f"{channel.peer} asked for piece {piece!r} of {name!r}")
                start, end = piece * PIECE_BYTES, min(manifest.sizes[name], (piece + 1) * PIECE_BYTES)
                if (left := left - (end - start)) < 0:
                    return await channel.fail("asked for more than the whole corpus on one stream")
                for offset in range(start, end, DATA_BYTES):
                    began = loop.time()
                    data = await loop.run_in_executor(self.pool, _read, self.folder / name, offset,
                                                      min(DATA_BYTES, end - offset))
                    await channel.send(Kind.DATA, data)
                    await asyncio.sleep(max(0.0, len(data) / self.rate - (loop.time() - began)))  # the rate cap
        finally:
            self._busy -= 1


def _read(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


class Fetch:
    """The pieces fetched so far into `<folder>.fetch/`, kept across restarts (`have.json`)."""

    def __init__(self, folder: Path):
        self.folder, self.work = folder, folder.with_name(folder.name + ".fetch")
        self.manifest: Optional[Manifest] = None
        self.have: set[tuple[str, int]] = set()

    def begin(self, manifest: Manifest) -> None:
        """Go on from the pieces already here if they were fetched for the same piece hashes, else start over."""
        try:
            noted = json.loads((self.work / "have.json").read_text())
            same = Manifest.parse(_unhex(noted["manifest"])) == manifest
            have = {(name, piece) for name, piece in noted["have"]} if same else set()
        except (OSError, ValueError, KeyError, TypeError, CorpusRefused):
            same, have = False, set()
        if not same:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work.mkdir(parents=True)
            for name in FILES:
                with open(self.work / name, "wb") as f:
                    f.truncate(manifest.sizes[name])
        self.manifest, self.have = manifest, have
        self.note()

    def bytes_had(self) -> int:
        """Bytes of the pieces already here."""
        return sum(min(self.manifest.sizes[n] - p * PIECE_BYTES, PIECE_BYTES) for n, p in self.have)

    def missing(self) -> list[tuple[str, int]]:
        return [(n, p) for n in FILES for p in range(len(self.manifest.pieces[n])) if (n, p) not in self.have]

    def write(self, name: str, piece: int, data: bytes) -> None:
        with open(self.work / name, "r+b") as f:
            f.seek(piece * PIECE_BYTES)
            f.write(data)
        self.have.add((name, piece))

    def note(self) -> None:
        tmp = self.work / "have.json.tmp"
        tmp.write_text(json.dumps({"manifest": _hexed(self.manifest.to_dict()), "have": sorted(self.have)}))
        os.replace(tmp, self.work / "have.json")

    def finish(self, sha256: str, tokenizer: str, vocab_size: int, sep_id: int, donor: str) -> None:
        """Check the whole against the run's hash (CorpusForged, everything dropped, if it differs); then
        meta.json, and the folder renamed into place."""
        if (got := digest(self.work)) != sha256:
            shutil.rmtree(self.work, ignore_errors=True)
            raise CorpusForged(f"the pieces {donor} sent hash to {got[:16]}, not the run's corpus {sha256[:16]}")
        itemsize = np.dtype(self.manifest.dtype).itemsize
        meta = {"format": FORMAT, "dtype": self.manifest.dtype, "tokenizer": tokenizer, "vocab_size": vocab_size,
                "sep_id": sep_id, "documents": None, "sha256": sha256, "fetched_from": donor,
                **{f"{split}_tokens": self.manifest.sizes[f"{split}.bin"] // itemsize for split in SPLITS}}
        for split in SPLITS:  # document keys are not part of the corpus's content: not fetched
            (self.work / f"{split}_keys.txt").write_text("")
        (self.work / "have.json").unlink()
        (self.work / "meta.json").write_text(json.dumps(meta, indent=1))
        write_stamp(self.work)
        os.replace(self.work, self.folder)


def _hexed(manifest: dict) -> dict:
    return {**manifest, "pieces": {k: [h.hex() for h in v] for k, v in manifest["pieces"].items()}}


def _unhex(manifest: dict) -> dict:
    return {**manifest, "pieces": {k: [bytes.fromhex(h) for h in v] for k, v in manifest["pieces"].items()}}


async def fetch(p2p: P2P, donor: PeerID, name: str, stall: float, min_bandwidth: float, into: Fetch, sha256: str,
                progress: Callable[[int], None]) -> None:
    """Fetch from `donor` every piece `into` lacks; CorpusRefused or a WireError if it does not serve them.
    `progress(nbytes)` is called once the pieces already here are known (with 0), then after each piece written."""
    channel = await Channel.open(p2p, donor, name, stall)
    try:
        await channel.send_control(Kind.HELLO, {"corpus": sha256})
        manifest = Manifest.parse(await channel.recv_control())
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, into.begin, manifest)
        progress(0)  # what was here before
        noted = time.monotonic()
        for name_, piece in into.missing():
            await channel.send_control(Kind.HELLO, {"file": name_, "piece": piece})
            size = min(manifest.sizes[name_] - piece * PIECE_BYTES, PIECE_BYTES)
            data, hashed, budget = bytearray(), hashlib.sha256(), transfer_deadline(size, stall, min_bandwidth)
            try:
                async with asyncio.timeout(budget):  # a donor that trickles is left for the next
                    while len(data) < size:
                        frame = await channel.recv_kind(Kind.DATA, min(DATA_BYTES, size - len(data)))
                        if not frame:
                            raise ProtocolError(f"{donor} sent an empty frame")
                        data += frame
                        hashed.update(frame)
            except TimeoutError:
                raise CorpusRefused(f"piece {piece} of {name_} from {donor} not done within {budget:.0f} s "
                                    f"(swarm.min_bandwidth)") from None
            if hashed.digest() != manifest.pieces[name_][piece]:
                raise CorpusRefused(f"piece {piece} of {name_} from {donor} does not match its hash")
            await loop.run_in_executor(None, into.write, name_, piece, bytes(data))
            progress(len(data))
            if time.monotonic() - noted > 1.0:
                await loop.run_in_executor(None, into.note)
                noted = time.monotonic()
        await loop.run_in_executor(None, into.note)
        await channel.send_control(Kind.HELLO, {"done": True})
    finally:
        channel.close()
