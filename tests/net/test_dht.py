"""start_dht: address validation, unreachable peers, busy port, run fingerprint, bootstrap command."""

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, fast_cfg
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from swarm.errors import SwarmError, UsageError
from swarm.net.dht import start_dht, visible_maddrs
from swarm.net.identity import load_identity

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)

FAKE_ID = "QmXfANcrDYnt5LTXKPtBALa9aXuZUrNNkRHZP6JWw9tYTE"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("key,value", [("initial_peers", "/ip4/1.2.3/tcp/5"), ("initial_peers", "/ip4/127.0.0.1/tcp/5"),
                                       ("host_maddrs", "not-a-multiaddr"), ("announce_maddrs", "/ip4/x")])
def test_malformed_multiaddr_is_a_usage_error(key, value):
    with pytest.raises(UsageError, match=key):
        start_dht(fast_cfg(**{key: [value]}))


@pytest.mark.timeout(40)
def test_unreachable_initial_peer_fails_within_bootstrap_timeout():
    silent = socket.socket()  # accepts TCP, never speaks libp2p
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
    try:
        for sock in (silent, closed):
            port = sock.getsockname()[1]
            start = time.monotonic()
            with pytest.raises(SwarmError, match="initial peers unreachable"):
                start_dht(fast_cfg(initial_peers=[f"/ip4/127.0.0.1/tcp/{port}/p2p/{FAKE_ID}"], bootstrap_timeout=8.0))
            assert time.monotonic() - start < 8.0 + 5.0
    finally:
        silent.close()
        closed.close()


@pytest.mark.timeout(20)
def test_port_in_use_names_the_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    try:
        with pytest.raises(SwarmError, match=f"port {port}"):
            start_dht(fast_cfg(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"]))
    finally:
        sock.close()


@pytest.mark.timeout(30)
def test_fingerprint_mismatch_is_refused(bootstrap):
    first = start_dht(fast_cfg(initial_peers=bootstrap), fingerprint="aaaa")
    try:
        with pytest.raises(SwarmError, match=r"refusing to join run 'swarm-tiny'.*fingerprint bbbb, the run's peers signed aaaa"):
            start_dht(fast_cfg(initial_peers=bootstrap), fingerprint="bbbb")
        same = start_dht(fast_cfg(initial_peers=bootstrap), fingerprint="aaaa")
        same.shutdown()
        other_run = start_dht(fast_cfg(initial_peers=bootstrap, run_id="other"), fingerprint="bbbb")
        other_run.shutdown()
    finally:
        first.shutdown()


@pytest.mark.timeout(30)
def test_identity_file_fixes_the_peer_id(tmp_path):
    cfg = fast_cfg(identity=str(tmp_path / "id.key"))
    ids = []
    for _ in range(2):
        dht = start_dht(cfg)
        ids.append(visible_maddrs(dht)[0].split("/p2p/")[1])
        dht.shutdown()
    assert ids[0] == ids[1]


@pytest.mark.timeout(30)
def test_the_daemon_serves_no_circuit_relay():
    """No peer relays strangers' circuits (swarm.net.p2pd.CONFIG): a peer of the swarm that asks another for a relay
    reservation is refused the protocol, while a protocol the daemon does serve (libp2p's ping) opens. No flag turns
    NAT port mapping or AutoNAT back on: NAT port mapping would probe the local network's gateway with UPnP and
    NAT-PMP from every peer, a test's included."""
    async def probe(client, peer_id) -> None:
        p2p = await client.replicate_p2p()
        _, _, writer = await p2p.call_binary_stream_handler(peer_id, "/ipfs/ping/1.0.0")
        writer.close()
        with pytest.raises(ControlFailure, match="protocols not supported"):
            await p2p.call_binary_stream_handler(peer_id, "/libp2p/circuit/relay/0.2.0/hop")

    server = start_dht(fast_cfg())
    try:
        args = Path(f"/proc/{server.p2pd.proc.pid}/cmdline").read_bytes().decode().split("\0")
        assert "-relay=0" in args and not {"-natPortMap=1", "-autonat=1", "-relay=1"} & set(args), args
        client = start_dht(fast_cfg(initial_peers=visible_maddrs(server)))
        try:
            asyncio.run(probe(client, server.peer_id))
        finally:
            client.shutdown()
    finally:
        server.shutdown()


@pytest.mark.timeout(40)
def test_a_key_file_made_now_is_started_without_hivemind_s_in_use_check(tmp_path, bootstrap):
    """hivemind dials a key file's peer id from a second daemon to see whether another peer already runs under it
    (best effort: through the DHT's peer routing, so not asserted here). A key file this process creates cannot
    be in use: it is marked made_now and started without the check; one that was there (a restart, a copied
    key) is not marked, and is checked as before."""
    key = tmp_path / "id.key"
    assert load_identity(str(key)).made_now and not load_identity(str(key)).made_now
    key.unlink()
    dht = start_dht(fast_cfg(identity=str(key), initial_peers=bootstrap))
    try:
        assert visible_maddrs(dht)[0].endswith(str(load_identity(str(key)).peer_id))
    finally:
        dht.shutdown()


@pytest.mark.timeout(40)
def test_swarm_bootstrap_prints_maddrs_logs_to_its_folder_and_stops_on_sigterm(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "swarm.cli", "bootstrap", "--swarm.host_maddrs",
                             "/ip4/127.0.0.1/tcp/0", "--out", str(tmp_path / "boot")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in line
        peer = start_dht(fast_cfg(initial_peers=[line]))  # others can join through it
        peer.shutdown()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert line in (tmp_path / "boot" / "log.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


STUCK_LOCK = """
import multiprocessing as mp, os, signal, time
from hivemind.utils.mpfuture import MPFuture
from swarm.config import SwarmConfig
from swarm.errors import SwarmError
from swarm.net.dht import start_dht

def hold_and_die(lock):  # a child killed while it reports to us: hivemind's shared lock stays taken
    lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)

child = mp.get_context("fork").Process(target=hold_and_die, args=(MPFuture._update_lock,))
child.start()
child.join()
try:
    start_dht(SwarmConfig(bootstrap_timeout=0.5))
    raise SystemExit("a DHT started although its child could not report")
except SwarmError as e:
    print(e)
# The start after it must succeed. Its time-out also bounds p2pd's own start-up, which is not under test and
# takes over 0.5 s on a loaded machine; a lock still stuck makes it fail within 2 x 10 + 10 s all the same.
dht = start_dht(SwarmConfig(bootstrap_timeout=10))
print("recovered")
dht.shutdown()
"""


@pytest.mark.timeout(60)
def test_a_start_killed_mid_report_does_not_break_later_starts():
    """Under load, a child killed just as it reported its failure left every later DHT start timing out."""
    out = subprocess.run([sys.executable, "-c", STUCK_LOCK], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the DHT did not start within 11 s" in out.stdout and out.stdout.strip().endswith("recovered")
