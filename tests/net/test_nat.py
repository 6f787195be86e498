"""A peer behind a NAT (`swarm.client_mode`) trains with the swarm: network namespaces, real processes.

    public bridge (10.233.<k>.0/24, bench/swarmrun.py's Namespaces): bootstrap .1, peer-0 .2, peer-1 .3, router .4
    home (10.234.<k>.2/24) --veth-- router (10.234.<k>.1) --MASQUERADE--> the bridge

The home namespace's only route goes through the router, which masquerades what leaves for the bridge: the NATed
peer dials out (its packets carry the router's address), nobody can dial it (the public namespaces have no route
to 10.234.<k>.0/24, and the router forwards nothing it did not see leave). Every address exists only inside these
namespaces.

libp2p opens a stream over any connection already up between two peers, whoever dialed it: a public peer can reach
the NATed one over the connection the NATed one opened, as long as that connection lives. So "it worked" would prove
little: a client registers no stream handler at all (peer.py), and any stream a groupmate opened to it would fail
its round. Measured: with the client's parts given back to it (layout without clients), every round fails with
"protocols not supported" and the peers never finish. Needs root, `ip netns` and iptables (`make install-system` installs iptables): without them the test
fails, naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import spawn, stop, wait_for_line
from bench.swarmrun import Namespaces, netns_available, sh
from swarm.net.allreduce import agree
from tests.swarm_harness import SMALL

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)

ROUNDS = 3
PUBLIC = 4  # namespaces on the bridge: the bootstrap, two public peers, the router


class BehindNat:
    """A `home` namespace routed through namespace `router` of `nets`, which masquerades; removed on exit."""

    def __init__(self, nets: Namespaces, router: int):
        self.nets, self.router = nets, router
        self.ns = f"{nets.tag}-home"
        self.subnet = f"10.234.{os.getpid() % 250}"
        self.addr = f"{self.subnet}.2"

    def __enter__(self) -> BehindNat:
        router, pid = self.nets.ns(self.router), os.getpid()
        inner, outer = f"swb{pid}h", f"swb{pid}r"
        try:
            sh("ip", "netns", "add", self.ns)
            sh("ip", "link", "add", inner, "netns", self.ns, "type", "veth", "peer", "name", outer, "netns", router)
            sh("ip", "-n", self.ns, "addr", "add", f"{self.addr}/24", "dev", inner)
            sh("ip", "-n", router, "addr", "add", f"{self.subnet}.1/24", "dev", outer)
            for ns, dev in ((self.ns, inner), (self.ns, "lo"), (router, outer)):
                sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", self.ns, "route", "add", "default", "via", f"{self.subnet}.1")
            sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            sh("ip", "netns", "exec", router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o",
               self.nets.device(self.router), "-j", "MASQUERADE")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def tcp_connect(ns: str, host: str, port: int) -> str:
    """Connect from namespace `ns` to host:port: 'connected', or the error."""
    code = (f"import socket\ntry:\n    socket.create_connection(({host!r}, {port}), timeout=3).close()\n"
            f"    print('connected')\nexcept OSError as e:\n    print(repr(e))")
    return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def check_tools() -> None:
    missing = [tool for tool in ("ip", "iptables", "tc") if shutil.which(tool) is None]
    assert os.geteuid() == 0 and not missing, (
        f"the NAT test needs root and ip, tc, iptables (missing: {missing or 'root'}); `make install-system` "
        f"installs iptables")
    ok, why = netns_available()
    assert ok, f"the NAT test needs network namespaces (`ip netns add` as root): {why}"


@pytest.mark.timeout(420)
def test_a_peer_behind_a_nat_takes_part_and_ends_on_the_swarms_hash(tmp_path: Path):
    check_tools()
    procs: list[subprocess.Popen] = []
    with Namespaces(PUBLIC, "1000mbit") as nets, BehindNat(nets, router=PUBLIC - 1) as home:
        try:
            # the NAT works: home dials out; nobody dials home, neither its address nor the router's
            listener = subprocess.Popen(["ip", "netns", "exec", home.ns, sys.executable, "-c",
                                         "import socket, time\ns = socket.create_server(('0.0.0.0', 47111))\n"
                                         "s.settimeout(20)\ntry:\n    s.accept()\nexcept OSError:\n    pass"],
                                        start_new_session=True)
            procs.append(listener)
            public = subprocess.Popen(["ip", "netns", "exec", nets.ns(1), sys.executable, "-c",
                                       "import socket\ns = socket.create_server(('0.0.0.0', 47112))\n"
                                       "s.settimeout(20)\ntry:\n    s.accept()\nexcept OSError:\n    pass"],
                                      start_new_session=True)
            procs.append(public)
            time.sleep(1.0)
            assert tcp_connect(home.ns, nets.addr(1), 47112) == "connected"
            for target in (home.addr, nets.addr(PUBLIC - 1)):
                result = tcp_connect(nets.ns(1), target, 47111)
                assert result != "connected" and ("unreachable" in result or "refused" in result), result

            out = tmp_path
            boot_log = out / "bootstrap.log"
            prefix = lambda ns: ["ip", "netns", "exec", ns]  # noqa: E731
            procs.append(boot := spawn(["-m", "swarm.cli", "bootstrap", "--swarm.host_maddrs",
                                        f"/ip4/{nets.addr(0)}/tcp/0", "--out", str(out / "boot")], boot_log,
                                       prefix(nets.ns(0))))
            maddr = wait_for_line(boot_log, rf"/ip4/{nets.addr(0)}/tcp/\d+/p2p/\w+", boot)
            where = [(nets.ns(1), nets.addr(1), []), (nets.ns(2), nets.addr(2), []),
                     (home.ns, home.addr, ["--client-mode"])]
            # every peer holds before round 1 until all three joined: rounds of 4 tiny inner steps end within a
            # second, and a peer whose start took 12 s in a loaded suite found the other two at round 3
            hold = out / "start-hold"
            hold.touch()
            peers = []
            for i, (ns, addr, extra) in enumerate(where):
                argv = ["-m", "swarm.cli", "peer", "--config", "configs/tiny.yaml", *SMALL, *extra,
                        "--initial-peers", maddr, "--name", f"peer-{i}", "--out", str(out / f"peer-{i}"),
                        "--data.shard", str(i), "--diloco.rounds", str(ROUNDS), "--diloco.inner_steps", "4",
                        "--swarm.host_maddrs", f"/ip4/{addr}/tcp/0", "--swarm.target_group_size", "3",
                        "--faults.hold_round", "1", "--faults.hold_file", str(hold),
                        "--swarm.compression", "none"]  # the byte shares checked below are fp32's
                peers.append(spawn(argv, out / f"peer-{i}" / "log.txt", prefix(ns)))
            procs += peers
            for i, peer in enumerate(peers):
                wait_for_line(out / f"peer-{i}" / "log.txt", "holding before round 1", peer, timeout=180)
            hold.unlink()
            deadline = time.time() + 300
            while any(p.poll() is None for p in peers) and time.time() < deadline:
                time.sleep(0.5)
            logs = {i: (out / f"peer-{i}" / "log.txt").read_text()[-1500:] for i in range(3)}
            assert all(p.returncode == 0 for p in peers), f"exit codes {[p.returncode for p in peers]}: {logs}"
        finally:
            stop(procs)

    summaries = [json.loads((out / f"peer-{i}" / "peer.json").read_text()) for i in range(3)]
    client = summaries[2]
    assert len({s["final_global_sha256"] for s in summaries}) == 1, [s["final_global_sha256"] for s in summaries]
    assert all(s["rounds_completed"] == ROUNDS for s in summaries), [s["rounds_completed"] for s in summaries]
    averaged = [r for r in client["rounds"] if r["committed"] and r["group_size"] == 3]
    assert averaged, f"the NATed peer never averaged in a group of 3: {client['rounds']}"
    # vector V, 2 owners: an owner sends V/2 to the other owner and its part's average (V/2) to 2 groupmates,
    # 1.5 V; the client sends its V to the owners, and nothing else (frame headers aside) but the agreement on
    # every part's bytes, at most agree.wire_bytes(3) on either side
    for owner in summaries[:2]:
        sent = {r["round"]: r["bytes_sent"] for r in owner["rounds"] if r["committed"] and r["group_size"] == 3}
        for mine in [r for r in averaged if r["round"] in sent]:
            theirs = sent[mine["round"]]
            assert abs(mine["bytes_sent"] - 2 / 3 * theirs) < 0.01 * theirs + agree.wire_bytes(3), (mine, sent)
    donors = [e.get("donor") for s in summaries for e in s["events"] if e["event"] == "state_downloaded"]
    assert client["peer_id"] not in donors, donors  # it never served its state
