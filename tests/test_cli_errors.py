"""Bad input at the command line: one line on stderr naming the culprit, and the documented exit code.

The commands run in this process (the `cli` fixture) but one, which goes through the real entry point
(`python -m swarm.cli`) to check that an exit code and the error line reach the shell."""

import socket
import time

import pytest

from tests.conftest import run_cli, scratch_folder
from tests.swarm_harness import local_swarm

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]  # slow: starts `swarm` processes and peers

PEER = ["peer", "--config", "configs/tiny.yaml", "--data.max_documents", "60"]
SOME_ID = "12D3KooWMJQ578M5fLBwELxBrNAd8j1GwELtCAgM7vBxgNojeWMJ"


def one_line_error(result) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("swarm: error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def test_malformed_multiaddr_exits_2_naming_it(cli):
    result = cli(*PEER, "--initial-peers", "not-a-maddr")
    assert result.returncode == 2
    assert "not-a-maddr" in one_line_error(result)


def test_unreachable_initial_peer_exits_1_in_bounded_time(cli):
    start = time.time()
    result = cli(*PEER, "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{SOME_ID}")
    assert result.returncode == 1
    assert "unreachable" in one_line_error(result)
    assert time.time() - start < 40


def test_port_in_use_exits_1_naming_the_port(cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli(*PEER, "--swarm.host_maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert result.returncode == 1
    assert str(port) in one_line_error(result)


def test_bad_kill_spec_exits_2(cli):
    result = cli("local", "--config", "configs/tiny.yaml", "--kill", "two@2")
    assert result.returncode == 2
    assert "--kill" in one_line_error(result)


@pytest.mark.parametrize("spec,culprit", [("nan", "--hostile 'nan'"), ("sneaky@1", "unknown attack 'sneaky'"),
                                          ("nan@7", "no peer 7")])
def test_bad_hostile_spec_exits_2(spec, culprit, cli):
    result = cli("local", "--config", "configs/tiny.yaml", "--peers", "4", "--hostile", spec)
    assert result.returncode == 2
    assert culprit in one_line_error(result)


@pytest.mark.parametrize("args,culprit", [
    (["--peers", "8", "--swarm.target_group_size", "3"], "swarm.target_group_size 3 with 8 peers"),
    (["--peers", "100"], "data.num_shards is 64")])
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_local_swarm_that_could_not_agree_or_fit_exits_2_dry_run_or_not(args, culprit, dry_run, cli):
    """Groups that cannot hold half the swarm would end on several models (8 peers in groups of 3 ended on 5):
    refused before anything starts, and a dry run refuses what the real run would."""
    result = cli("local", "--config", "configs/tiny.yaml", *args, *dry_run)
    assert result.returncode == 2
    assert culprit in one_line_error(result)


def test_a_local_swarm_whose_honest_peers_disagree_fails_saying_so(tmp_path):
    from peers.local_swarm import check_agreement
    from swarm.errors import SwarmError

    honest, killed = {"final_global_sha256": "a", "rounds_completed": 3}, {"final_global_sha256": "c",
                                                                            "rounds_completed": 1}
    check_agreement([honest, killed, {"final_global_sha256": "b", "rounds_completed": 3, "hostile": ["nan"]}], 3,
                    tmp_path)
    with pytest.raises(SwarmError, match="ended on 2 different models"):
        check_agreement([honest, {"final_global_sha256": "b", "rounds_completed": 3}], 3, tmp_path)


def test_an_unreadable_identity_file_exits_2(tmp_path, cli):
    (tmp_path / "id.key").write_bytes(b"not a key")
    result = cli(*PEER, "--swarm.identity", str(tmp_path / "id.key"))
    assert result.returncode == 2
    assert "swarm.identity" in one_line_error(result) and "id.key" in one_line_error(result)


def test_a_join_after_the_last_round_exits_2(cli):
    result = cli("local", "--config", "configs/tiny.yaml", "--rounds", "3", "--join", "4")
    assert result.returncode == 2
    assert "--join 4" in one_line_error(result)


def test_monitor_port_in_use_exits_1_naming_the_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.time()
        scratch = scratch_folder()
        result = run_cli("monitor", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{SOME_ID}", "--run", "r",
                         "--http-port", str(port), cwd=scratch)
    assert result.returncode == 1
    assert f"port {port}" in one_line_error(result)
    assert time.time() - start < 30  # refused before any DHT starts
    assert f"port {port}" in (scratch / "runs" / "monitor-r" / "log.txt").read_text()  # beside its history


def test_monitor_unreadable_multiaddr_exits_2_naming_it(cli):
    result = cli("monitor", "--initial-peers", "not-a-maddr", "--run", "r")
    assert result.returncode == 2
    assert "not-a-maddr" in one_line_error(result)


def test_monitor_bad_port_exits_2(cli):
    result = cli("monitor", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{SOME_ID}", "--run", "r",
                 "--http-port", "70000")
    assert result.returncode == 2
    assert "port 70000" in one_line_error(result)
    result = cli("monitor", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{SOME_ID}", "--run", "r", "--port", "8470")
    assert result.returncode == 2
    assert one_line_error(result) == ("swarm: error: swarm monitor --port is now --http-port: --port is a peer's TCP "
                                      "port on the other commands")


def test_local_monitor_port_in_use_exits_1_naming_the_port(cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("local", "--config", "configs/tiny.yaml", "--peers", "1", "--monitor-port", str(port))
    assert result.returncode == 1
    assert f"port {port}" in one_line_error(result)


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory, fork_server):
    """A bootstrap DHT holding no run but what a test stores; its multiaddr."""
    with local_swarm(tmp_path_factory.mktemp("bootstrap"), fork_server) as swarm:
        yield swarm.start_bootstrap()


def test_join_overriding_a_run_key_exits_2_naming_it(cli):
    result = cli("join", "swarm-tiny", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{SOME_ID}",
                 "--diloco.threads", "1", "--model.hidden_size", "64")
    assert result.returncode == 2
    assert "cannot override model.hidden_size when joining run 'swarm-tiny'" in one_line_error(result)


def test_join_a_run_nobody_holds_exits_1_naming_the_run_and_the_dht(bootstrap, cli):
    start = time.time()
    result = cli("join", "no-such-run", "--initial-peers", bootstrap, "--swarm.bootstrap_timeout", "5")
    assert result.returncode == 1
    line = one_line_error(result)
    assert "no manifest of run 'no-such-run'" in line and bootstrap in line
    assert time.time() - start < 40


def test_join_a_manifest_this_version_cannot_read_exits_1_naming_why(bootstrap, cli):
    from hivemind.utils.timed_storage import get_dht_time

    from swarm.config import SwarmConfig
    from swarm.net import schema
    from swarm.net.dht import start_dht
    from swarm.net.identity import load_identity
    from swarm.net.manifest import shared_config
    from tests.conftest import tiny_config

    cfg = tiny_config(swarm={"run_id": "future-run"})
    shared = shared_config(cfg)
    shared["model"]["flash"] = True  # a key a newer version knows
    identity = load_identity(None)
    dht = start_dht(SwarmConfig(run_id="future-run", initial_peers=[bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
                    identity, fingerprint="f" * 16)  # signs the run's fingerprint
    try:
        now = get_dht_time()
        assert dht.store(schema.manifest_key("future-run"), schema.ManifestRecord(
            config=shared, fingerprint="f" * 16, creator=str(identity.peer_id), time=now,
            version=schema.MANIFEST_VERSION).dict(), subkey=identity.owner, expiration_time=now + 600)
        result = cli("join", "future-run", "--initial-peers", bootstrap, "--swarm.bootstrap_timeout", "10")
    finally:
        dht.shutdown()
    assert result.returncode == 1
    assert ("manifest of run 'future-run' refused: this version cannot read its config (unknown config key "
            "'model.flash')") in one_line_error(result)


def test_runs_in_a_dht_without_runs_says_so(bootstrap, cli):
    result = cli("runs", "--initial-peers", bootstrap, "--swarm.bootstrap_timeout", "20")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"no runs advertised in the DHT of {bootstrap}"
