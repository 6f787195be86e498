"""`swarm peer`: one training peer in a swarm, started from `--initial-peers` or starting a new swarm.

After it signed the run's fingerprint and built its model it stores, where the run needs more copies, the
run's manifest and its entry in the run index (swarm/net/manifest.py: what `swarm join` and `swarm runs`
read). Besides training it writes, into its run folder, `status.json` (round, inner step, loss; refreshed
about once a second, for `swarm local`'s live view), `peer.json` (this peer's summary entry) and
`summary.json`; log.txt and metrics.csv come from swarm/run/logs.py and swarm/run/metrics.py. Its log says, one line
each, that it joined (or started) the run and on which TCP port it listens, each group formed, each round
committed with its hash, each state taken and from whom, and that it left; a warning if nobody outside its
network can dial it (swarm/net/addresses.py). While it trains it shows its progress (swarm/run/progress.py).
Without `data.shard` it leases a data shard through the DHT (swarm/net/leases.py, swarm/data/leases.py): disjoint
from the live peers' while there are free shards, its own again after a restart under the same name.
SIGTERM and SIGINT end it cleanly (exit 143 and 130): the DHT and averager shut down, the last committed
round's checkpoint is finished on disk, and `peer.json` and `summary.json` say where it stopped.

With `--nproc-per-node K` (peers/launch.py, or under torchrun) each of the peer's K ranks runs `run_peer`; rank 0
is the endpoint above, the others train alongside it (swarm/train/ranks.py) and each writes `ranks/rank-<k>.json` with
the round and state hash (swarm/state/statehash.py) it ended on."""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Optional

import torch

from swarm.config import Config, FaultsConfig
from swarm.errors import stop_on
from swarm.run.report import peak_rss_bytes, peer_summary, write_json, write_summary
from swarm.train.ranks import Ranks
from swarm.train.trainer import Trainer

log = logging.getLogger("swarm.peer")


class StatusFile:
    """A small JSON file with this peer's live progress, rewritten at most once a second."""

    def __init__(self, path: Path):
        self.path, self.last = path, 0.0

    def update(self, force: bool = False, **fields) -> None:
        now = time.time()
        if force or now - self.last >= 1.0:
            write_json(self.path, {"time": now, **fields})
            self.last = now


def run_peer(cfg: Config, out_dir: Path, name: Optional[str]) -> Path:
    ranks = Ranks.from_env()
    stop_on(signal.SIGTERM)
    if cfg.diloco.threads:
        torch.set_num_threads(cfg.diloco.threads)
    ranks.init(cfg)  # the process group lives until the process ends (peers.launch.exit_rank)
    if ranks.endpoint:
        return _run_endpoint(cfg, out_dir, name, ranks)
    from swarm.net.codec import kept_dtype

    name, peer_id = ranks.share(None)
    trainer = Trainer(cfg, ranks.averager(None, networked=True, kept_dtype=kept_dtype(cfg.swarm.compression)),
                      peer_id=peer_id, shard=cfg.data.shard, out_dir=out_dir, ranks=ranks, name=name)
    trainer.train()
    write_rank(out_dir, ranks, trainer)
    ranks.drain()
    return out_dir / "summary.json"


def _peer_json(out_dir: Path, trainer: Trainer, name: str, ranks: Ranks) -> dict:
    summary = peer_summary(trainer.progress.history, ranks.world_size)
    summary["name"] = name
    write_json(out_dir / "peer.json", summary)
    return summary


def exchange_faults(cfg: Config) -> FaultsConfig:
    """The faults the averager injects, which counts exchanges by the outer steps committed before them: with
    diloco.fragments F, round R's closing exchange is the one after R * F - 1 outer steps."""
    if cfg.faults.kill_phase != "allreduce" or cfg.faults.kill_round is None:
        return cfg.faults
    return dataclasses.replace(cfg.faults, kill_round=cfg.faults.kill_round * cfg.diloco.fragments)


def write_rank(out_dir: Path, ranks: Ranks, trainer: Trainer) -> None:
    """Where this rank ended: every rank of a peer must hold the same global parameters."""
    if ranks.distributed:
        (out_dir / "ranks").mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "ranks" / f"rank-{ranks.rank}.json", {
            "rank": ranks.rank, "round": trainer.diloco.round, "global_sha256": trainer.diloco.global_sha256(),
            "peak_rss_bytes": peak_rss_bytes()})


def _run_endpoint(cfg: Config, out_dir: Path, name: Optional[str], ranks: Ranks) -> Path:
    from peers.folder import peer_name
    from swarm.data.tokens import corpus_folder
    from swarm.net.addresses import tcp_port, unreachable_warning
    from swarm.net.dht import start_dht, visible_maddrs
    from swarm.net.identity import load_identity, with_work
    from swarm.net.ledger import Ledger
    from swarm.net.limits import raise_open_files
    from swarm.net.manifest import publish as publish_manifest
    from swarm.net.peer import SwarmAverager
    from swarm.run.progress import Progress
    from swarm.run.runid import run_identity
    from swarm.train.model import count_parameters

    start = time.time()
    raise_open_files()  # every incoming stream is a file descriptor (swarm/net/limits.py)
    out_dir.mkdir(parents=True, exist_ok=True)
    # the key and the ledger stay in the peer's folder: a restart is the same peer to the swarm (ledger.py), under
    # the same name (peers/folder.py), so with the same batch order and data shard
    key = load_identity(cfg.swarm.identity or str(out_dir / "identity.key"))
    name = peer_name(name, key.peer_id.to_base58())
    status = StatusFile(out_dir / "status.json")
    status.update(force=True, name=name, state="starting", round=0, step=0, loss=None)

    run = run_identity(cfg)  # prepares the corpus if it is not yet: its hash is part of the run
    identity = with_work(key, cfg.swarm.identity_work)
    dht = start_dht(cfg.swarm, identity, run=run)
    averager, trainer = None, None
    try:
        maddrs = visible_maddrs(dht)
        peer_id = dht.peer_id.to_base58()
        port = tcp_port(maddrs)
        if cfg.swarm.initial_peers:
            log.info("peer %s (%s) joined run %r (fingerprint %s), listening on TCP port %s", name, peer_id,
                     cfg.swarm.run_id, run.fingerprint, port)
        else:
            log.info("started a new swarm for run %r (fingerprint %s), listening on TCP port %s (open it to let "
                     "peers in); others join with: --initial-peers %s", cfg.swarm.run_id, run.fingerprint, port,
                     " ".join(maddrs))
        if warning := unreachable_warning(maddrs, cfg.swarm.client_mode):
            log.warning("%s", warning)
        print("\n".join(maddrs), flush=True)
        averager = SwarmAverager(cfg.swarm, dht, identity, run.fingerprint, name, exchange_faults(cfg),
                                 Ledger(out_dir / "ledger.json"))
        averager.corpus.offer(corpus_folder(cfg.data))  # to peers that fetch it (swarm/net/corpussync.py)
        ranks.share((name, peer_id))
        leases = None  # data.shard unset: the shard is leased through the DHT (swarm/net/leases.py)
        if cfg.data.shard is None:
            from swarm.net.leases import ShardLeases

            leases = ShardLeases(cfg, dht, identity, name)

        def on_round(record) -> None:
            status.update(force=True, name=name, peer_id=peer_id, state="training", round=record.round,
                          step=0, loss=record.train_loss, eval_loss=record.eval_loss, committed=record.committed)

        trainer = Trainer(cfg, ranks.averager(averager, networked=True),
                          peer_id=peer_id, shard=cfg.data.shard, out_dir=out_dir, on_round=on_round, ranks=ranks,
                          name=name, leases=leases)

        # Before train(): the heartbeat stores nothing until the trainer's first progress, so this thread has
        # the DHT's pipe to itself.
        publish_manifest(dht, cfg, run, identity, count_parameters(trainer.model))
        shown = Progress(cfg, name)

        def progress(round_: int, step: int, loss: float) -> None:
            status.update(name=name, peer_id=peer_id, state="training", round=round_, step=step, loss=loss)
            shown.step(round_, step, loss, trainer.progress.step)

        try:
            trainer.train(progress)
            write_rank(out_dir, ranks, trainer)
            ranks.drain()
            status.update(force=True, name=name, peer_id=peer_id, state="done", round=trainer.diloco.round, step=0,
                          loss=None)
        finally:  # finished, stopped or failed: say where this peer got to
            shown.close()
            trainer.progress.history.events += averager.access.events  # peers refused, banned or ignored, and why
            path = write_summary(out_dir, cfg.swarm.run_id, "peer", cfg.to_dict(), time.time() - start,
                                 [_peer_json(out_dir, trainer, name, ranks)])
        return path
    finally:
        if averager is not None:
            averager.close()
        dht.shutdown()
        if trainer is not None:
            log.info("left run %r at round %d (global %s)", cfg.swarm.run_id, trainer.diloco.round,
                     (trainer.diloco.known_sha256() or "not known")[:12])
