"""Time-outs that follow the bytes, over a real slow link: two members in their own network namespaces,
joined by a veth pair shaped by tbf to 8 Mbit/s (1 MB/s) in both directions.

- Slow but steady: 10 MB each way take about 11 s, several times swarm.stall_timeout (3 s); the all-reduce
  succeeds because bytes keep moving, within its deadline from the bytes and min_bandwidth (53 s).
- Stalled: the link goes down mid-transfer; both members give up within stall_timeout of it (plus slack),
  not after the bandwidth deadline.

(TCP over a tail-dropping queue pauses for up to ~1 s at a time here: stall_timeout must be above that, as on
any real link; the queue is 1 s deep to keep the pauses short.)
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.swarmrun import Namespaces
from swarm.net.budget import transfer_deadline

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)

SCRIPT = Path(__file__).with_name("shaped_proc.py")
REPO = Path(__file__).resolve().parents[2]
RATE, LATENCY, NUMEL, STALL, MIN_BANDWIDTH = "8mbit", "1s", 2_500_000, 3.0, 200_000.0
BYTES_EACH_WAY = NUMEL * 4  # n = 2: half the vector out as a contribution, the other half's average back


def start_member(nets: Namespaces, i: int, folder: Path, initial_peers: list[str]) -> subprocess.Popen:
    job = dict(name=f"m{i}", host=nets.addr(i), initial_peers=initial_peers, dir=str(folder), numel=NUMEL,
               stall=STALL, min_bandwidth=MIN_BANDWIDTH, seed=i)
    log = open(folder / f"m{i}.log", "w")
    return subprocess.Popen(["ip", "netns", "exec", nets.ns(i), sys.executable, str(SCRIPT), json.dumps(job)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_file(path: Path, procs: list[subprocess.Popen], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert all(p.poll() is None for p in procs), f"a member exited before writing {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.05)
    time.sleep(0.05)  # written in one go, but give the writer its moment
    return path.read_text()


def run_pair(folder: Path, stall_after: float | None = None) -> tuple[list[dict], float | None]:
    """Both members averaging over the shaped link; with `stall_after`, the link of member 1 goes down that
    many seconds after they started. Returns their results and when the link went down."""
    procs, stalled_at = [], None
    with Namespaces(2, RATE, LATENCY) as nets:
        try:
            procs.append(start_member(nets, 0, folder, []))
            maddr = wait_file(folder / "m0.maddr", procs, 60)
            procs.append(start_member(nets, 1, folder, [maddr]))
            for i in range(2):
                wait_file(folder / f"m{i}.id", procs, 60)
            (folder / "go").touch()
            if stall_after is not None:
                time.sleep(stall_after)
                nets.set_link(1, up=False)
                stalled_at = time.time()
            results = [json.loads(wait_file(folder / f"m{i}.json", [], 120)) for i in range(2)]
            for p in procs:
                p.wait(30)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
    return results, stalled_at


@pytest.mark.timeout(180)
def test_a_slow_but_steady_transfer_succeeds_past_the_stall_timeout(tmp_path):
    results, _ = run_pair(tmp_path)
    logs = [(tmp_path / f"m{i}.log").read_text()[-2000:] for i in range(2)]
    assert all(r["ok"] for r in results), (results, logs)
    assert results[0]["sha256"] == results[1]["sha256"]
    # 10 MB each way at 1 MB/s: several stall_timeouts long, within the deadline
    assert all(3 * STALL < r["seconds"] < transfer_deadline(BYTES_EACH_WAY, STALL, MIN_BANDWIDTH) for r in results), \
        results


@pytest.mark.timeout(180)
def test_a_stalled_transfer_fails_within_the_stall_timeout(tmp_path):
    results, stalled_at = run_pair(tmp_path, stall_after=3.0)
    assert not any(r["ok"] for r in results), results
    for r in results:  # well before the bandwidth deadline (53 s)
        assert r["end"] - stalled_at < STALL + 2.0, (r, r["end"] - stalled_at)
    assert any("stall" in r["error"].lower() or "no byte" in r["error"] for r in results), results
