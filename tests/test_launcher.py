"""`swarm local` leaves nothing behind: killed -9, stopped by SIGTERM (then it still writes its summary); run again
in its folder, it starts on its own bootstrap, not the last run's."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peers.children import bootstrap_maddr, spawn_child, stop_children
from tests.conftest import scratch_folder
from tests.swarm_harness import SMALL

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def training(peer: Path) -> bool:
    try:
        return json.loads((peer / "status.json").read_text())["state"] == "training"
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return False


def start_launcher(out: Path) -> tuple[subprocess.Popen, set[int]]:
    """`swarm local` with two peers and a long run; returns once both peers train (past their start-up), with every
    process under it."""
    launcher = subprocess.Popen([sys.executable, "-m", "swarm.cli", "local", "--config", "configs/tiny.yaml",
                                 "--peers", "2", "--rounds", "50", "--out", str(out), "--no-monitor", *SMALL],
                                cwd=scratch_folder(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not all(training(out / f"peer-{i}") for i in range(2)):
        assert launcher.poll() is None and time.time() < deadline, launcher.stdout.read()[-3000:]
        time.sleep(0.5)
    return launcher, descendants(launcher.pid)


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.time() + timeout
    while time.time() < deadline and any(map(alive, pids)):
        time.sleep(0.2)
    return {p for p in pids if alive(p)}


@pytest.mark.timeout(180)
def test_a_launcher_killed_minus_9_takes_every_child_with_it(tmp_path):
    launcher, children = start_launcher(tmp_path / "run")
    assert len(children) >= 3  # the bootstrap and two peers, with their DHT processes and p2pd daemons
    launcher.kill()
    launcher.wait()
    assert wait_gone(children, timeout=30) == set()


@pytest.mark.timeout(180)
def test_a_launcher_stopped_by_sigterm_stops_every_child_and_writes_its_summary(tmp_path):
    launcher, children = start_launcher(tmp_path / "run")
    launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert wait_gone(children, timeout=10) == set()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sorted(p["name"] for p in summary["peers"]) == ["peer-0", "peer-1"]
    assert "swarm: stopped by SIGTERM" in output and "summary of the interrupted run" in output
    assert os.path.exists(tmp_path / "run" / "loss.png")


def test_a_launcher_re_run_in_its_folder_reads_its_own_bootstrap_s_address(tmp_path, fork_server, monkeypatch):
    """`make swarm` run twice: `bootstrap.log` still held the last run's address when the launcher read it, before the
    new bootstrap's fork emptied the file, and every peer dialed a bootstrap that was gone."""
    monkeypatch.chdir(tmp_path)  # where the bootstrap writes its own runs/bootstrap/log.txt
    log = tmp_path / "bootstrap.log"
    stale = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    log.write_text(f"{stale}\n")
    boot = spawn_child(fork_server, "bootstrap", ["bootstrap", "--swarm.host_maddrs", "/ip4/127.0.0.1/tcp/0"], log)
    try:
        maddr = bootstrap_maddr(boot, log)
    finally:
        stop_children([boot])
    assert maddr != stale and maddr in log.read_text()
