"""The processes a launcher starts (`swarm local`, and the tests' swarms): forked from a fork server, each in a
session of its own, stopped as a group (SIGTERM, a grace period, then SIGKILL to the whole group, hivemind's DHT
process and p2pd daemon included)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from peers.forkserver import Forked, ForkServer
from swarm.errors import SwarmError

BOOTSTRAP_TIMEOUT_S = 60.0  # the bootstrap prints its multiaddrs within seconds; past this it is broken
STOP_GRACE_S = 15.0  # a peer asked to stop gets this long to shut down its DHT before SIGKILL


@dataclass
class Child:
    name: str
    proc: Forked
    out_dir: Optional[Path]


def spawn_child(server: ForkServer, name: str, argv: list[str], log_path: Path,
                out_dir: Optional[Path] = None) -> Child:
    """`swarm <argv>` forked by `server`, in a session of its own, logging to `log_path`; it gets SIGTERM when
    this launcher dies (peers/forkserver.py)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # emptied now, as the child will empty it once forked: a reader that looks before that must not take a line of
    # the last run's log (a `swarm local` re-run in its folder read the last bootstrap's address, long gone)
    log_path.write_bytes(b"")
    return Child(name, server.spawn(argv, log_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}), out_dir)


def stop_children(children: list[Child]) -> None:
    """SIGTERM every live child, wait up to STOP_GRACE_S, then SIGKILL each child's whole process group."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + STOP_GRACE_S
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)  # the group also holds the DHT child and p2pd
        except ProcessLookupError:
            pass
        child.proc.wait()


def bootstrap_maddr(child: Child, log_path: Path) -> str:
    deadline = time.time() + BOOTSTRAP_TIMEOUT_S
    while time.time() < deadline:
        if child.proc.poll() is not None:
            raise SwarmError(f"the bootstrap peer exited with status {child.proc.returncode}: see {log_path}")
        for line in log_path.read_text().splitlines():
            if line.startswith("/ip4/127.0.0.1/") and "/p2p/" in line:
                return line.strip()
        time.sleep(0.2)
    raise SwarmError(f"the bootstrap peer printed no multiaddr within {BOOTSTRAP_TIMEOUT_S:.0f}s: see {log_path}")
