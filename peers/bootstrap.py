"""`swarm bootstrap`: a DHT-only peer whose multiaddrs others pass as --initial-peers."""

from __future__ import annotations

from typing import Optional

from swarm.config import SwarmConfig


def run_bootstrap(identity: Optional[str], host_maddrs: list[str], announce_maddrs: list[str],
                  initial_peers: list[str]) -> int:
    from swarm.net.dht import run_bootstrap as serve

    serve(SwarmConfig(identity=identity, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs,
                      initial_peers=initial_peers))
    return 0
