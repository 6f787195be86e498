"""Where a peer listens and what it announces: `--port`, `--announce-ip`, and whether others can dial it.

A peer listens on every interface (`/ip4/0.0.0.0/tcp/PORT`, the default of `swarm.host_maddrs`), on `--port`
or any free port, which it prints at start: the one TCP port to open in a firewall. It announces the
addresses it listens on, or `--announce-ip IP` on that port (a cloud VM whose public IP is not on any of its
interfaces). If everything it announces is private or loopback, it warns: peers outside its network cannot
dial it, and it should announce a public IP or run in client mode (`--client-mode`: it dials out only).
Pure functions (no hivemind): the command line checks its options before anything starts.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from typing import Optional

from swarm.errors import UsageError

ANY = "/ip4/0.0.0.0/tcp/{port}"


def check_port(port: int, option: str = "--port") -> None:
    """UsageError naming `option` if `port` is not a TCP port or is already taken on this machine."""
    if not 0 <= port <= 65535:
        raise UsageError(f"{option} {port}: not a TCP port (0-65535)")
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"{option} {port}: address already in use (another peer on this machine? "
                                 f"pick another port)") from None
            raise UsageError(f"{option} {port}: cannot listen on it ({e.strerror})") from None


def free_port() -> int:
    """A TCP port free on every interface now (the peer binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("0.0.0.0", 0))
        return probe.getsockname()[1]


def network_overrides(port: Optional[int], announce_ip: Optional[str]) -> list[str]:
    """The config overrides `--port` and `--announce-ip` stand for (UsageError naming a bad one). An announced
    address needs a known port: without `--port`, a free one is picked now."""
    out: list[str] = []
    if port is not None:
        check_port(port)
    if announce_ip is not None:
        try:
            ip = ipaddress.ip_address(announce_ip)
        except ValueError:
            raise UsageError(f"--announce-ip {announce_ip!r}: not an IP address (e.g. 203.0.113.7)") from None
        port = port or free_port()
        out += ["--swarm.announce_maddrs", f"/ip{ip.version}/{ip}/tcp/{port}"]
    if port is not None:
        out += ["--swarm.host_maddrs", ANY.format(port=port)]
    return out


def _ip(maddr: str) -> Optional[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    found = re.match(r"/ip[46]/([^/]+)/", maddr)
    try:
        return ipaddress.ip_address(found[1]) if found else None
    except ValueError:
        return None


def tcp_port(maddrs: list[str]) -> Optional[int]:
    """The TCP port of the first of `maddrs` that has one."""
    for maddr in maddrs:
        if found := re.search(r"/tcp/(\d+)", maddr):
            return int(found[1])
    return None


DOCUMENTATION = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24",
                                                  "2001:db8::/32")]
"""Addresses that examples use (the README's 203.0.113.7) and no machine has."""


def unreachable_warning(maddrs: list[str], client_mode: bool, can_be_client: bool = True) -> Optional[str]:
    """A warning if every one of `maddrs` (what this peer announces) is private or loopback: nobody outside
    this network can dial it. None for a client (it is never dialed) or if one is public. `can_be_client`:
    whether to suggest client mode (a bootstrap must be dialed)."""
    ips = [ip for ip in map(_ip, maddrs) if ip is not None]
    if client_mode or any(ip.is_global for ip in ips):
        return None
    port = tcp_port(maddrs)
    if examples := sorted({str(ip) for ip in ips if any(ip.version == n.version and ip in n for n in DOCUMENTATION)}):
        return (f"this peer announces {', '.join(examples)}, an address reserved for documentation (RFC 5737, "
                f"RFC 3849) that nobody can dial: pass --announce-ip with this machine's public IP, and open TCP "
                f"port {port if port is not None else '(see --port)'}")
    return (f"this peer announces only private or loopback addresses ({', '.join(sorted(map(str, set(ips))))}): "
            f"peers outside this network cannot dial it. On a machine with a public IP, pass --announce-ip IP "
            f"and open TCP port {port if port is not None else '(see --port)'}"
            + ("; behind a NAT, run with --client-mode" if can_be_client else ""))
