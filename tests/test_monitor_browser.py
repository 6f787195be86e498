"""The monitor on a real swarm: `swarm local` (2 peers) starts one, `swarm monitor` joins as a second; a
headless Chromium renders the page and the DOM must list the peers and chart their eval loss; `/metrics`
must parse as Prometheus text with a round gauge per peer. Chromium comes from the system (`make test`
installs Debian's `chromium` when it is missing)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import scratch_folder
from tests.swarm_harness import SMALL

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)

DEADLINE_S = 90  # the whole test, start to cleanup; it takes ~40 s on 2 idle cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), to clean up after a launcher that could not stop its children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def wait_for(what: str, check, deadline: float, proc: subprocess.Popen, log: Path):
    while time.time() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode} while waiting for {what}:\n{log.read_text()[-3000:]}"
        got = check()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {DEADLINE_S} s:\n{log.read_text()[-3000:]}")


def api_when_ready(url: str):
    """The JSON once both peers are live and the chart has two rounds (the initial eval and round 1 or later)."""
    try:
        snap = json.loads(get(url + "api/swarm"))
    except OSError:  # the monitor is not serving yet
        return None
    live = {p["name"] for p in snap["peers"] if p["live"]}
    return snap if live == {"peer-0", "peer-1"} and len(snap["eval"]) >= 2 else None


@pytest.mark.timeout(DEADLINE_S + 60)
def test_monitor_page_lists_live_peers_and_charts_eval_loss(tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    deadline = time.time() + DEADLINE_S
    port, second_port = free_port(), free_port()
    cwd = scratch_folder()  # the monitors keep their history under runs/: never the repository's
    log, second_log = tmp_path / "local.log", tmp_path / "monitor.log"
    # Rounds far beyond the test's time: the swarm is stopped (Ctrl-C) once the page is checked.
    launcher = subprocess.Popen(
        [sys.executable, "-m", "swarm.cli", "local", "--config", "configs/tiny.yaml", "--peers", "2", "--rounds", "500",
         "--diloco.inner_steps", "8", *SMALL, "--out", str(tmp_path / "run"), "--monitor-port", str(port)],
        cwd=cwd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
        # a test run started in the background of a script (`make test &`) ignores SIGINT, and so would the
        # launcher (an ignored signal stays ignored across exec): give it Ctrl-C back
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    second = None
    try:
        url = wait_for("monitor URL", lambda: re.search(r"monitor at (http://\S+/)", log.read_text()), deadline,
                       launcher, log)[1]
        assert url == f"http://127.0.0.1:{port}/"
        maddr = re.search(r"bootstrap at (\S+)", log.read_text())[1]
        second = subprocess.Popen(
            [sys.executable, "-m", "swarm.cli", "monitor", "--initial-peers", maddr, "--run", "swarm-tiny",
             "--http-port", str(second_port), "--swarm.request_timeout", "1"],  # the live window of SMALL's peers
            cwd=cwd, stdout=open(second_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        snap = wait_for("two live peers and two eval rounds", lambda: api_when_ready(url), deadline, launcher, log)

        budget_ms = 3000  # virtual time for the page's script: its first fetch and a few polls
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                              f"--user-data-dir={tmp_path / 'chromium'}", f"--virtual-time-budget={budget_ms}",
                              "--dump-dom", url],
                             capture_output=True, text=True, timeout=max(5.0, deadline - time.time())).stdout
        table = re.search(r'<table id="peers">.*?</table>', dom, re.S)
        assert table, dom[-2000:]
        assert "peer-0" in table[0] and "peer-1" in table[0]
        points = int(re.search(r'<svg id="chart"[^>]*data-points="(\d+)"', dom)[1])
        assert points >= len(snap["eval"]) >= 2  # the monitor only ever gains rounds
        assert dom.count("<circle") == points
        assert "join" in dom  # the peers' joins among the events

        families = {f.name: f for f in text_string_to_metric_families(get(url + "metrics").decode())}
        rounds = {s.labels["peer"]: s.value for s in families["swarm_peer_round"].samples}
        assert set(rounds) == {"peer-0", "peer-1"} and max(rounds.values()) >= 1

        second_snap = wait_for("the second monitor's view", lambda: api_when_ready(f"http://127.0.0.1:{second_port}/"),
                               deadline, second, second_log)
        assert {p["name"] for p in second_snap["peers"]} == {"peer-0", "peer-1"}

        launcher.send_signal(signal.SIGINT)  # like Ctrl-C: the launcher stops its peers and its monitor
        assert launcher.wait(timeout=max(1.0, deadline - time.time())) == 128 + signal.SIGINT
        with pytest.raises(OSError):
            get(url)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=max(1.0, deadline - time.time())) == 0
    finally:
        for proc in (launcher, second):
            if proc is not None and proc.poll() is None:
                for pid in [proc.pid, *descendants(proc.pid)]:
                    try:
                        os.killpg(pid, signal.SIGKILL)  # the children run in their own process groups
                    except (ProcessLookupError, PermissionError):
                        pass
                proc.wait()
