"""A peer's folder: stable by default, so that running the same command again resumes.

    swarm peer --config C [--initial-peers ...]    runs/<run>/<hostname>   (a second peer of this machine: -2)
    swarm peer --config C --name N ...            runs/<run>/N
    swarm peer --config C --solo                  runs/<run>/solo
    swarm join RUN ...                            runs/<run>/<hostname>, or runs/<run>/N
    swarm local --config C                        runs/<run>/, its peers in runs/<run>/peer-<i>/

After a crash, a reboot or Ctrl-C the same command finds the same folder and resumes from its checkpoint (a
networked peer then takes the swarm's state if the swarm is further: swarm/train/trainer_state.py `catch_up`);
`--fresh` deletes the folder's checkpoints and metrics.csv first. The first log line says which it does.

A peer's name (`peer_name`) is not its folder's: `--name` if given, else the hostname and the end of the peer id of
the key its folder keeps (`identity.key`), e.g. `ubuntu-x3Fq9k`. The name seeds the peer's batch order and finds
its data shard's lease again after a restart; a key is unique where a hostname is not (two machines called
`ubuntu` drew the same batches and fought over one lease), and kept in the folder it survives restarts.

`claim` takes the folder for this process: an exclusive `flock` on `<folder>/.lock`, which the kernel drops
when the process ends, however it ends (forked children close their copy at once). A derived folder that
another live process holds gives way to the next name (`<hostname>-2`, ...): two peers started on one machine
get two folders (and two keys), each the same one again when restarted in the same order.
An `--out` folder in use is refused.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Optional

from swarm.config import Config
from swarm.errors import SwarmError, UsageError

log = logging.getLogger("swarm.folder")
MAX_SAME_NAME = 64  # peers of one run on one machine under one derived name


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


class PeerFolder:
    """The folder a command trains in (`path`), the peer name given on the command line (None: `peer_name`'s
    default), and the lock that holds it while this process lives."""

    def __init__(self, path: Path, name: Optional[str], fd: Optional[int]):
        self.path, self.name, self._fd = path, name, fd
        if fd is not None:  # a forked child (hivemind's DHT) must not keep the folder locked after we die
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> PeerFolder:
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _lock(path: Path, option: str) -> Optional[int]:
    """An fd holding the exclusive lock of the folder `path` (created), or None if another process holds it;
    UsageError naming the folder (and `option`, where it came from) if it cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UsageError(f"cannot write the peer folder {path} ({option}): {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _holder(path: Path) -> str:
    try:
        return f"process {(path / '.lock').read_text().strip()}"
    except OSError:
        return "another process"


def claim(out: Optional[str], run_id: str, name: Optional[str], kind: str, lock: bool = True) -> PeerFolder:
    """The folder of a `kind` command ("peer", "solo" or "local"): `out` if given, else derived from the run and
    `name` (peers: the hostname by default). `lock`: take it for this process (off for the ranks of a peer,
    whose launcher holds it). SwarmError if `out` is in use."""
    if out is not None:
        path = Path(out)
        fd = _lock(path, "--out") if lock else None
        if lock and fd is None:
            raise SwarmError(f"peer folder {path} is in use by {_holder(path)}: stop it, or pass another --out")
        return PeerFolder(path, name, fd)
    base = Path("runs") / _safe(run_id)
    if kind == "local":
        leaf, stem = None, None
    else:
        stem = name or ("solo" if kind == "solo" else _safe(socket.gethostname()))
        leaf = stem
    for k in range(1, MAX_SAME_NAME + 1):
        suffix = "" if k == 1 else f"-{k}"
        path = base / f"{leaf}{suffix}" if leaf is not None else base.with_name(base.name + suffix)
        fd = _lock(path, "the default peer folder: pass --out") if lock else None
        if fd is not None or not lock:
            return PeerFolder(path, name, fd)
        if name is not None:  # a peer named on the command line is that peer: never another
            raise SwarmError(f"peer {name} of run {run_id!r} is running already ({path} is held by {_holder(path)})")
    raise SwarmError(f"{MAX_SAME_NAME} peers of run {run_id!r} run here already under {base}")


def peer_name(given: Optional[str], peer_id: str) -> str:
    """The name a peer goes by (module docstring): `given` (`--name`), else `<hostname>-<last 6 of its peer id>`."""
    return given or f"{_safe(socket.gethostname())}-{peer_id[-6:]}"


def start(folder: Path, cfg: Config, fresh: bool, networked: bool) -> None:
    """Delete the folder's checkpoints, metrics and ledger with `fresh`; then log, as the peer's first line, whether it
    resumes (and from which round) or starts fresh."""
    from swarm.state.checkpoint import Checkpointer, CorruptCheckpoint

    where = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else folder / "checkpoint"
    checkpoints = Checkpointer(where)
    if fresh:
        gone = [p for p in (*checkpoints.rounds(), checkpoints.latest()) if p is not None]
        for path in sorted(set(gone)):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        (folder / "metrics.csv").unlink(missing_ok=True)
        (folder / "ledger.json").unlink(missing_ok=True)  # who it averaged with; its key (identity.key) stays
        log.info("peer folder %s: starting fresh (--fresh: %s)", folder,
                 f"deleted {len(set(gone))} checkpoint(s) in {where}" if gone else "there was no checkpoint")
        return
    latest = checkpoints.latest()
    if latest is None or cfg.checkpoint.every == 0 or not cfg.checkpoint.resume:
        why = "no checkpoint there" if latest is None else f"checkpoints off; {latest} left as it is"
        log.info("peer folder %s: starting fresh (%s)", folder, why)
        return
    try:
        done = checkpoints.read_meta()["round"]
        round, then = f"of round {done}", "; then from the swarm's state if the swarm is further" if networked else ""
        if done >= cfg.diloco.rounds:
            then = f"; the run has {cfg.diloco.rounds} rounds: nothing is left to train"
    except (CorruptCheckpoint, KeyError, TypeError) as e:
        round, then = f"(which does not read: {e})", ""
    log.info("peer folder %s: resuming from its checkpoint %s, %s%s (--fresh starts over)", folder, round, latest,
             then)
