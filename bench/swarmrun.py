"""Run a real swarm (a bootstrap and N `swarm peer` processes) on loopback, or with every process in its own
network namespace behind a tbf-shaped link.

Namespaces: `swb-<pid>-hub` holds a bridge; `swb-<pid>-<i>` (i = 0 the bootstrap, 1..N the peers) each hold
one end of a veth pair whose other end sits on the bridge, with an address 10.233.<k>.<i+1>/24 that exists
only inside these namespaces (no route leaves them). tbf caps both directions of every veth at the link
rate. Everything is removed in `finally`, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Optional

from bench.common import spawn, stop, wait_for_line, write_config
from swarm.config import Config


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


def netns_available() -> tuple[bool, str]:
    name = f"swb-{os.getpid()}-probe"
    try:
        sh("ip", "netns", "add", name)
        sh("ip", "netns", "exec", name, "tc", "qdisc", "show")
        return True, "ok"
    except (OSError, subprocess.SubprocessError) as e:
        return False, getattr(e, "stderr", None) or repr(e)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Namespaces:
    """`n` namespaces on one bridge, each link shaped to `rate` (tc syntax, e.g. '20mbit'); `latency`: how long a
    packet may wait in tbf's queue before it is dropped."""

    def __init__(self, n: int, rate: str, latency: str = "100ms"):
        self.tag, self.n, self.rate, self.latency = f"swb-{os.getpid()}", n, rate, latency
        self.subnet = f"10.233.{os.getpid() % 250}"
        self.names: list[str] = []

    def ns(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def device(self, i: int) -> str:
        """Namespace i's end of its link."""
        return f"swb{os.getpid()}a{i}"

    def set_link(self, i: int, up: bool) -> None:
        """Take namespace i's link down (nothing crosses it, every connection over it stalls) or back up."""
        sh("ip", "-n", self.ns(i), "link", "set", self.device(i), "up" if up else "down")

    def __enter__(self) -> Namespaces:
        hub = f"{self.tag}-hub"
        try:
            sh("ip", "netns", "add", hub)
            self.names.append(hub)
            sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", hub, "link", "set", "br0", "up")
            rate_bits = float(self.rate.rstrip("mbit")) * 1e6
            burst = str(max(32_000, int(rate_bits / 8 / 100)))  # 10 ms of traffic, at least 32 kB
            for i in range(self.n):
                ns, inner, outer = self.ns(i), self.device(i), f"swb{os.getpid()}b{i}"
                sh("ip", "netns", "add", ns)
                self.names.append(ns)
                sh("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", hub)
                sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", inner)
                sh("ip", "-n", ns, "link", "set", inner, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", hub, "link", "set", outer, "master", "br0")
                sh("ip", "-n", hub, "link", "set", outer, "up")
                for where, dev in ((ns, inner), (hub, outer)):  # both directions of the link
                    sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                       self.rate, "burst", burst, "latency", self.latency)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def shaped_bytes(self) -> dict[str, int]:
        """Bytes each tbf has sent so far (both ends of every link), to check that traffic went through them."""
        out = {}
        for name in self.names:
            text = subprocess.run(["ip", "netns", "exec", name, "tc", "-s", "qdisc", "show"], capture_output=True,
                                  text=True).stdout
            for dev, sent in re.findall(r"qdisc tbf \S+ dev (\S+) .*?\n\s*Sent (\d+) bytes", text, re.S):
                out[f"{name}:{dev}"] = int(sent)
        return out

    def __exit__(self, *exc) -> None:
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.names.clear()


def run_swarm(cfg: Config, n_peers: int, out: Path, rate: Optional[str] = None, timeout: float = 900) -> dict:
    """Train `cfg` on a bootstrap + `n_peers` peers (shards 0..n-1); `rate`: namespaces behind tbf links.
    Returns {"peers": [peer.json dicts], "wall_s": ..., "failed": [names]}."""
    out.mkdir(parents=True, exist_ok=True)
    config = write_config(cfg, out / "config.yaml")
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as stack:
        nets = stack.enter_context(Namespaces(n_peers + 1, rate)) if rate else None
        host = (lambda i: nets.addr(i)) if nets else (lambda i: "127.0.0.1")
        prefix = (lambda i: ["ip", "netns", "exec", nets.ns(i)]) if nets else (lambda i: None)
        try:
            start = time.time()
            boot_log = out / "bootstrap.log"
            boot = spawn(["-m", "swarm.cli", "bootstrap", "--swarm.host_maddrs", f"/ip4/{host(0)}/tcp/0"], boot_log,
                         prefix(0))
            procs.append(boot)
            maddr = wait_for_line(boot_log, rf"/ip4/{host(0)}/tcp/\d+/p2p/\w+", boot)
            peers = []
            for i in range(n_peers):
                d = out / f"peer-{i}"
                argv = ["-m", "swarm.cli", "peer", "--config", str(config), "--initial-peers", maddr,
                        "--name", f"peer-{i}", "--out", str(d), "--data.shard", str(i),
                        "--swarm.host_maddrs", f"/ip4/{host(i + 1)}/tcp/0",
                        "--swarm.target_group_size", str(max(2, n_peers)), "--diloco.threads", "1",
                        "--logging.progress_bar", "false"]
                peers.append(spawn(argv, d / "log.txt", prefix(i + 1)))
            procs += peers
            deadline = time.time() + timeout
            while any(p.poll() is None for p in peers) and time.time() < deadline:
                time.sleep(0.5)
            wall = time.time() - start
            shaped = nets.shaped_bytes() if nets else {}
        finally:
            stop(procs)
    summaries, failed = [], []
    for i, p in enumerate(peers):
        path = out / f"peer-{i}" / "peer.json"
        if p.returncode != 0 or not path.exists():
            failed.append(f"peer-{i} (exit {p.returncode})")
        if path.exists():
            summaries.append(json.loads(path.read_text()))
    return {"peers": summaries, "wall_s": wall, "failed": failed, "shaped_bytes": shaped}


def utilization(peer: dict) -> dict:
    """One peer's inner-step seconds / training wall seconds, from its round records. Training wall: from the
    start of its first round to the close of its last (start-up excluded; evals and all-reduces included)."""
    rounds = peer["rounds"]
    wall = max(r["time"] for r in rounds) - rounds[0]["start_time"]
    compute = sum(r["compute_s"] for r in rounds)
    tokens = sum(r["tokens_per_s"] * r["compute_s"] for r in rounds)
    # The steady state: from the start of round 2 to the start of the last round (round 1's warm-up, the last
    # round's exchange with no inner steps to hide behind and the final eval left out), as a long run sees it.
    middle = rounds[1:-1]
    steady = (sum(r["compute_s"] for r in middle) / (rounds[-1]["start_time"] - middle[0]["start_time"])
              if middle else None)
    return {"utilization": compute / wall, "steady": steady, "compute_s": compute, "wall_s": wall, "tokens": tokens,
            "overhead_s_per_round": sum(r["overhead_s"] - r["eval_s"] for r in rounds) / len(rounds),
            "comm_s_per_round": sum(r["comm_s"] for r in rounds) / len(rounds), "rounds": len(rounds),
            "bytes_sent_per_round": sum(r["bytes_sent"] for r in rounds) / len(rounds)}
