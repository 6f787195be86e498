"""The p2pd daemon under a peer's DHT, started by swarm with the libp2p services it uses and no others.

hivemind's `P2P.create` starts p2pd with command-line flags, and p2pd's flags can switch a service on but never
off: its config starts with circuit relay enabled, so every daemon ran the relay transport and a relay *service*
that any stranger could reserve slots and relay circuits through, whatever `use_relay=False` said. Starting that
service also builds an IP-to-AS table, most of a daemon's CPU at start and a good part of its memory. p2pd's JSON
config, which it reads from stdin (`-i`), can switch relay off. So swarm starts the daemon itself, with that
config, and hands hivemind's DHT the daemon's control socket (`hivemind.DHT(p2p=...)`): the DHT's child process
connects to it as hivemind's own would.

A daemon exits by itself once every client that held a persistent connection to it is gone (the DHT child, the
averager's replicas), so a peer killed with -9 leaves none behind; one that no client ever reached exits after
`IDLE_TIMEOUT`. `Daemon.close` stops it at once.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Optional

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE, P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

CONFIG = {"Relay": {"Enabled": False}, "AutoNat": False, "NatPortMap": False}
"""What p2pd runs beyond a host, its control socket and libp2p's peer routing (server mode, or client mode for a
`swarm.client_mode` peer): no circuit relay (a client dials out and needs none; a relayed connection is capped far
below a round's bytes), no NAT port mapping (it would map the DHT's port only, not the data plane's, and probe the
local network with UPnP multicast) and no AutoNAT service (reachability is declared, `swarm.client_mode`; the
service dials back addresses that remote peers name). Flags add to this config and never take away from it."""

IDLE_TIMEOUT = 30.0  # seconds a daemon waits for its first client before it exits (hivemind's default)
TAIL_LINES = 20  # lines of the daemon's output kept to explain a failed start


@dataclass
class Daemon:
    """A running p2pd: its process and the control socket (`daemon_listen_maddr`, the name hivemind's DHT reads)."""

    proc: subprocess.Popen
    daemon_listen_maddr: Multiaddr
    owner_pid: int = field(default_factory=os.getpid)  # a forked child never stops its parent's daemon
    _reader: Optional[threading.Thread] = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))

    @classmethod
    def start(cls, *, host_maddrs: list[str], announce_maddrs: list[str], initial_peers: list[str], key_file: str,
              client_mode: bool, timeout: float) -> Daemon:
        """Start p2pd under `key_file`'s identity, listening on `host_maddrs` and, with `initial_peers`, connected
        to them before it is up. Raises hivemind's `P2PDaemonError`, whose text `swarm.net.dht` explains, when it
        exits first (a port in use, no initial peer answering) or is not up within `timeout` seconds."""
        name = f"/tmp/swarm-p2pd-{secrets.token_urlsafe(8)}"
        config = Path(f"{name}.json")
        config.write_text(json.dumps(CONFIG))
        socket = f"{name}.sock"
        args = [str(files("hivemind.hivemind_cli") / "p2pd"), f"-f={config}", "-relay=0",  # the flag's default is 1
                f"-listen=/unix{socket}", f"-id={key_file}", "-dhtClient=1" if client_mode else "-dhtServer=1",
                "-connManager=1", f"-idleTimeout={IDLE_TIMEOUT:g}s",
                f"-persistentConnMaxMsgSize={DEFAULT_MAX_MSG_SIZE}"]
        for flag, maddrs in (("hostAddrs", host_maddrs), ("announceAddrs", announce_maddrs),
                             ("bootstrapPeers", initial_peers)):
            if maddrs:
                args.append(f"-{flag}={','.join(maddrs)}")
        if initial_peers:
            args.append("-b=1")
        env = {**os.environ, "GOLOG_LOG_FMT": "json"}
        env.setdefault("GOLOG_LOG_LEVEL", "warn")
        try:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=env)
        except BaseException:
            config.unlink()
            raise
        daemon = cls(proc, Multiaddr(f"/unix{socket}"))
        try:
            daemon._reader = threading.Thread(target=daemon._read, name="p2pd-output", daemon=True)
            daemon._reader.start()
            deadline = time.monotonic() + timeout
            while not daemon._ready.wait(0.05):
                if proc.poll() is not None:
                    daemon._reader.join(1.0)  # the last lines it wrote
                    raise P2PDaemonError(f"Daemon failed to start: {daemon._failure()}")
                if time.monotonic() > deadline:
                    raise P2PDaemonError(f"Daemon failed to start in {timeout:.1f} seconds")
        except BaseException:
            daemon.close()
            raise
        finally:
            config.unlink()  # read at start
        return daemon

    def close(self, timeout: float = 5.0) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL past `timeout`) and reap it; a no-op in a forked child."""
        if os.getpid() != self.owner_pid:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout)
        self.proc.stdout.close()
        try:
            os.remove(self.daemon_listen_maddr["unix"])
        except FileNotFoundError:
            pass  # p2pd removes its socket when it stops cleanly

    def _read(self) -> None:
        """Drain the daemon's output for its life (a full pipe would stall it): log it, keep its tail, and note
        the line p2pd prints once its host is up."""
        for raw in self.proc.stdout:
            line = raw.rstrip().decode(errors="replace")
            self._tail.append(line)
            logger.debug(f"p2pd: {line}")
            if line.startswith("Peer ID:"):
                self._ready.set()

    def _failure(self) -> str:
        """The daemon's own last word on why it stopped: the last line that is not a stack frame."""
        lines = [line for line in self._tail if line.strip() and not line.startswith(("\t", "goroutine "))]
        return lines[-1] if lines else f"exit status {self.proc.returncode}"


def identity_taken(key_file: str, initial_peers: list[str]) -> bool:
    """Whether a peer that `initial_peers` can reach already runs under `key_file`'s identity (hivemind's check: a
    second daemon dials the key's peer id)."""
    return asyncio.run(P2P.is_identity_taken(key_file, initial_peers=initial_peers, tls=True, use_auto_relay=False,
                                             use_ipfs=False, use_relay=False))
