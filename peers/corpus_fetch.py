"""`swarm join` on a machine without the run's corpus: fetch its token files from the run's live peers.

    swarm join RUN --initial-peers MADDR        # the corpus is neither prepared here nor preparable here

Before its peer starts, `swarm join` asks the run's live peers (their progress records, newest outer step first)
for the prepared corpus (swarm/net/corpussync.py: verified piece by piece, then whole against the run's corpus
hash), into the folder where `load_corpus` looks for it. A fetch that was killed goes on from the pieces already
here. The tokenizer is not fetched: a run on a Hugging Face tokenizer needs its files on this machine
(`--data.tokenizer PATH`); a byte-token run needs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Optional

from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from swarm.config import Config, live_window
from swarm.data.tokens import corpus_folder
from swarm.errors import SwarmError
from swarm.net import policy, schema
from swarm.net.corpussync import CorpusRefused, Fetch, fetch
from swarm.net.wire import WireError
from swarm.run.progress import clock
from swarm.run.runid import RunIdentity

log = logging.getLogger("swarm.join")


class FetchProgress:
    """Bytes fetched of the total, speed and time left: a live bar on a terminal, else a log line every `every`
    seconds and one at the end."""

    def __init__(self, total: int, already: int, every: float = 10.0):
        self.total, self.got, self.every = total, already, every
        self.start = self.last = time.monotonic()
        self.since = 0  # bytes fetched by this process (the speed's)
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc="fetching the corpus", total=total, initial=already, unit="B", unit_scale=True)

    def line(self) -> str:
        speed = self.since / max(time.monotonic() - self.start, 1e-9)
        left = (self.total - self.got) / speed if speed > 0 else None
        return (f"fetched {self.got / 1e6:.1f} of {self.total / 1e6:.1f} MB of the corpus "
                f"({100 * self.got / max(self.total, 1):.0f}%), {speed / 1e6:.1f} MB/s, done in {clock(left)}")

    def __call__(self, nbytes: int) -> None:
        self.got, self.since = self.got + nbytes, self.since + nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            log.info("%s", self.line())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def fetch_corpus(cfg: Config, run: RunIdentity) -> Path:
    """Fetch the corpus of `run` (its hash) from its live peers into `corpus_folder(cfg.data)`; SwarmError naming
    what was tried if no peer gave it."""
    from peers.join import probe_config
    from swarm.data.batches import build_tokenizer
    from swarm.net.dht import start_dht

    folder = corpus_folder(cfg.data)
    tokenizer = build_tokenizer(cfg.data)  # here, or a one-line error naming it: it is not fetched
    dht = start_dht(probe_config(cfg.swarm, cfg.swarm.run_id))
    try:
        deadline = time.monotonic() + cfg.swarm.bootstrap_timeout  # a peer that just started may not show yet
        while not (donors := _live_peers(dht, cfg)) and time.monotonic() < deadline:
            time.sleep(1.0)
        if not donors:
            raise SwarmError(f"run {cfg.swarm.run_id!r} has no live peer to fetch its corpus from (none within "
                             f"{cfg.swarm.bootstrap_timeout:g} s, swarm.bootstrap_timeout)")
        log.info("run %r trains on corpus sha256 %s, which is not here: fetching it from %d live peer(s) into %s",
                 cfg.swarm.run_id, run.corpus_sha256[:16], len(donors), folder)
        asyncio.run(_fetch(dht, donors, cfg, run, folder, tokenizer))
    finally:
        dht.shutdown()
    return folder


def _live_peers(dht, cfg: Config) -> list[str]:
    """The run's live peers by their progress records, the furthest first."""
    found = dht.get(schema.progress_key(cfg.swarm.run_id), latest=True)
    now = get_dht_time()
    live = [r for r in schema.read_owned(found, schema.ProgressRecord, now).values()
            if policy.is_live(r, now, live_window(cfg.swarm))]
    return [r.peer_id for r in sorted(live, key=lambda r: (-r.outer_step, r.peer_id))]


async def _fetch(dht, donors: list[str], cfg: Config, run: RunIdentity, folder: Path, tokenizer) -> None:
    p2p = await dht.replicate_p2p()
    into, tried = Fetch(folder), []
    name = schema.handler_name(cfg.swarm.run_id, run.fingerprint, "corpus")
    progress: Optional[FetchProgress] = None

    def shown(nbytes: int) -> None:
        nonlocal progress
        if progress is None:
            total, already = sum(into.manifest.sizes.values()), into.bytes_had()
            if already:
                log.info("going on with the %d piece(s) fetched before (%.1f MB)", len(into.have), already / 1e6)
            progress = FetchProgress(total, already)
        progress(nbytes)

    try:
        for donor in donors:
            try:
                await fetch(p2p, PeerID.from_base58(donor), name, cfg.swarm.stall_timeout, cfg.swarm.min_bandwidth,
                            into, run.corpus_sha256, shown)
                await asyncio.get_running_loop().run_in_executor(
                    None, into.finish, run.corpus_sha256, cfg.data.tokenizer, tokenizer.vocab_size, tokenizer.sep_id,
                    donor)
                log.info("%s from %s", progress.line() if progress else "fetched the corpus", donor)
                return
            except (CorpusRefused, WireError) as e:
                tried.append(f"{donor}: {e}")
                log.warning("fetching the corpus from %s failed: %s", donor, e)
    finally:
        if progress is not None:
            progress.close()
        await p2p.shutdown()
    raise SwarmError(f"no live peer of run {cfg.swarm.run_id!r} gave its corpus (sha256 {run.corpus_sha256[:16]}): "
                     + "; ".join(tried))
