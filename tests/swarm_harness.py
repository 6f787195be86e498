"""Real peers on loopback for tests: a bootstrap DHT and `swarm peer` processes, always cleaned up."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Iterator

import torch

from peers.children import Child, spawn_child, stop_children
from peers.forkserver import ForkServer
from swarm.config import SwarmConfig

# A model and run that make a 3-peer round take a few seconds on 2 cores; blocking rounds (configs/tiny.yaml
# overlaps them) unless a test asks for --diloco.delay.
SMALL = ["--model.hidden_size", "32", "--model.num_layers", "1", "--model.num_heads", "2",
         "--model.intermediate_size", "64", "--model.max_seq_len", "32", "--data.seq_len", "32",
         "--data.max_documents", "80", "--data.eval_batches", "2", "--inner.warmup_steps", "2",
         "--diloco.threads", "1", "--diloco.delay", "0", "--logging.progress_bar", "false",
         "--swarm.matchmaking_time", "3", "--swarm.request_timeout", "1", "--swarm.stall_timeout", "5",
         "--swarm.progress_expiration", "20", "--swarm.host_maddrs", "/ip4/127.0.0.1/tcp/0"]


class Swarm:
    def __init__(self, root: Path, server: ForkServer):
        self.root, self.server, self.children, self.dhts, self.maddr = root, server, [], [], None

    def start_bootstrap(self) -> str:
        """The DHT `swarm bootstrap --swarm.host_maddrs /ip4/127.0.0.1/tcp/0` runs (swarm.net.dht.run_bootstrap),
        started from this process: a `swarm bootstrap` process would first import hivemind and torch again,
        seconds before any peer can start (the command itself: tests/net/test_dht.py). Its multiaddr."""
        from swarm.net.dht import start_dht, visible_maddrs

        self.dhts.append(start_dht(SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"])))
        self.maddr = next(m for m in visible_maddrs(self.dhts[-1]) if m.startswith("/ip4/127.0.0.1/"))
        return self.maddr

    def start_peer(self, name: str, *overrides: str, config: str = "configs/tiny.yaml") -> Child:
        out = self.root / name
        argv = ["peer", "--config", config, *SMALL, *overrides, "--initial-peers", self.maddr,
                "--name", name, "--out", str(out)]
        child = spawn_child(self.server, name, argv, out / "log.txt", out)
        self.children.append(child)
        return child

    def wait(self, children: list[Child], timeout: float) -> None:
        deadline = time.time() + timeout
        for child in children:
            remaining = deadline - time.time()
            assert remaining > 0, f"{child.name} still running after {timeout}s:\n{self.log(child)[-3000:]}"
            child.proc.wait(timeout=remaining)

    @staticmethod
    def log(child: Child) -> str:
        return (child.out_dir / "log.txt").read_text() if child.out_dir else ""

    @staticmethod
    def summary(child: Child) -> dict:
        return json.loads((child.out_dir / "peer.json").read_text())

    @staticmethod
    def dumps(child: Child) -> list[dict]:
        return [torch.load(p, weights_only=False) for p in sorted((child.out_dir / "tensors").glob("attempt-*.pt"))]


@contextlib.contextmanager
def local_swarm(root: Path, server: ForkServer) -> Iterator[Swarm]:
    """Peers forked from `server` (the session's `fork_server` fixture), all stopped at the end."""
    swarm = Swarm(root, server)
    try:
        yield swarm
    finally:
        stop_children(swarm.children)
        for dht in swarm.dhts:
            dht.shutdown()
