"""Peers that need no network: `solo` (one peer) and `sim` (M replicas in one process, one thread each)."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import torch

from swarm.config import Config
from swarm.errors import UsageError
from swarm.run.progress import Progress
from swarm.run.report import format_table, peer_summary, write_summary
from swarm.train.averaging import SimAverager, SoloAverager
from swarm.train.ranks import Ranks
from swarm.train.trainer import Trainer


def run_solo(cfg: Config, out_dir: Path) -> Path:
    """Train one peer without network; write summary.json and loss.png into `out_dir`. On several ranks, the
    peer's ranks train it together (swarm/train/ranks.py) and rank 0 writes the summary."""
    from peers.node import write_rank

    start = time.time()
    if cfg.diloco.threads:
        torch.set_num_threads(cfg.diloco.threads)
    ranks = Ranks.from_env()
    ranks.init(cfg)
    shard = cfg.data.shard if cfg.data.shard is not None else 0
    averager = ranks.averager(SoloAverager() if ranks.endpoint else None, networked=False)
    trainer = Trainer(cfg, averager, peer_id="solo", shard=shard, out_dir=out_dir, ranks=ranks)
    shown = Progress(cfg, "solo", live=None if ranks.endpoint else False)
    try:
        history = trainer.train(lambda round_, step, loss: shown.step(round_, step, loss, trainer.progress.step))
    finally:
        shown.close()
    write_rank(out_dir, ranks, trainer)
    ranks.drain()
    peers = [peer_summary(history, ranks.world_size)]
    if not ranks.endpoint:
        return out_dir / "summary.json"
    path = write_summary(out_dir, cfg.swarm.run_id, "solo", cfg.to_dict(), time.time() - start, peers)
    print(format_table(peers))
    return path


def run_sim(cfg: Config, replicas: int, out_dir: Path) -> Path:
    """M replicas on disjoint shards, averaged in memory each round; write summary.json and loss.png."""
    start = time.time()
    trainers = simulate(cfg, replicas, out_dir)
    peers = [peer_summary(t.progress.history) for t in trainers]
    path = write_summary(out_dir, cfg.swarm.run_id, f"sim x{replicas}", cfg.to_dict(), time.time() - start, peers)
    print(format_table(peers))
    return path


def check_replicas(cfg: Config, replicas: int) -> None:
    """UsageError unless every one of `replicas` gets a data shard of its own."""
    if not 1 <= replicas <= cfg.data.num_shards:
        raise UsageError(f"--replicas {replicas} needs a data shard each: data.num_shards is {cfg.data.num_shards}")


def replica_folders(cfg: Config, replicas: int, out_dir: Path) -> list[tuple[Path, Config]]:
    """Each replica's folder (`out_dir`/replica-<i>) and config (its own checkpoint.dir, if one is set)."""
    out = []
    for i in range(replicas):
        replica_cfg = copy.deepcopy(cfg)
        if cfg.checkpoint.dir is not None:
            replica_cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir) / f"replica-{i}")
        out.append((out_dir / f"replica-{i}", replica_cfg))
    return out


def simulate(cfg: Config, replicas: int, out_dir: Path) -> list[Trainer]:
    """Train M replicas (shards 0..M-1) in M threads with the same loop as a real peer; return them."""
    if cfg.diloco.threads:
        torch.set_num_threads(cfg.diloco.threads)
    check_replicas(cfg, replicas)
    sim = SimAverager(replicas)
    trainers = []
    for i, (folder, replica_cfg) in enumerate(replica_folders(cfg, replicas, out_dir)):
        trainers.append(Trainer(replica_cfg, sim.member(i), peer_id=f"replica-{i}", shard=i, out_dir=folder))
    errors = []

    def work(i: int) -> None:
        try:
            trainers[i].train()
        except BaseException as e:  # one dead replica must not leave the others waiting at the barrier
            errors.append(e)
            sim.abort()

    threads = [threading.Thread(target=work, args=(i,), name=f"replica-{i}") for i in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return trainers
