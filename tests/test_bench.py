"""`make bench-quick` never overwrites the committed full-run results in bench/results; the utilization bench's
round model, closed-form and replayed over measured rounds, gives the numbers worked out by hand."""

import subprocess
import sys

import pytest

from bench.common import QUICK_RESULTS, RESULTS
from bench.utilization import replayed, round_model
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)


@pytest.mark.timeout(120)
def test_a_quick_run_writes_beside_the_committed_results():
    committed = {p.name: p.read_bytes() for p in RESULTS.iterdir() if p.is_file()}
    result = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--only", "compression"], cwd=ROOT,
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in RESULTS.iterdir() if p.is_file()} == committed
    assert '"quick": true' in (QUICK_RESULTS / "compression.json").read_text()
    assert "quick run" in (QUICK_RESULTS / "README.md").read_text()


@pytest.mark.parametrize("t_comm, delay, fragments, expected", [
    (0.5, 0, 1, 1 / 1.5),  # blocking: 1 s of inner steps, then 0.5 s of exchange
    (0.8, 5, 1, 1 / 1.3),  # 5 inner steps (0.5 s) hide 0.5 s of a 0.8 s exchange
    (0.3, 5, 1, 1.0),  # ... and all of a 0.3 s one
    (0.5, 4, 2, 1 / 1.2),  # two exchanges a round, each 0.1 s longer than the 4 inner steps behind it
])
def test_replayed_over_peers_of_equal_speed_the_round_model_is_the_closed_form(t_comm, delay, fragments, expected):
    rounds = [[1.0] * 8 for _ in range(3)]  # 3 peers, 8 rounds of 10 inner steps of 0.1 s
    assert round_model(10, 0.1, t_comm, delay, fragments=fragments) == pytest.approx(expected)
    assert replayed(rounds, 10, t_comm, delay, fragments) == pytest.approx([expected] * 3)


def test_replayed_a_fast_peer_waits_for_the_slowest():
    rounds = [[1.0] * 50, [1.5] * 50]  # a round takes 1 s on one peer, 1.5 s on the other
    fast, slow = replayed(rounds, 10, 0.1, 0)  # blocking: both wait for the slow peer's round and the exchange
    assert (fast, slow) == pytest.approx((1 / 1.6, 1.5 / 1.6))
    fast, slow = replayed(rounds, 10, 0.1, 5)  # delayed: the exchange hides behind the slow peer's steps ...
    assert slow == pytest.approx(1.0)
    assert fast == pytest.approx(1 / 1.5, abs=0.01)  # ... and the fast peer goes at its pace, after a transient


def test_the_churn_report_finds_the_minority_lineage_and_the_switches():
    from bench.churn import report

    def peer(hashes, downloads=(), final=None):
        rounds = [{"round": r + 1, "committed": True, "global_sha256": h} for r, h in enumerate(hashes)]
        return {"rounds": rounds, "final_global_sha256": final or hashes[-1], "rounds_completed": len(hashes),
                "events": [{"event": "state_downloaded", "from_round": a, "to_round": b} for a, b in downloads]}
    runs = [{"name": "p0", "index": 0, "killed": False, "rc": 0, "summary": peer(["a", "b", "c"]), "last_line": ""},
            {"name": "p1", "index": 1, "killed": False, "rc": 0, "summary": peer(["a", "b", "c"]), "last_line": ""},
            {"name": "p2", "index": 2, "killed": True, "rc": -9, "summary": None, "last_line": ""},
            {"name": "p3", "index": 3, "killed": False, "rc": 1, "summary": peer(["a", "x", "y"], [(1, 2)]),
             "last_line": "nobody serves it"}]
    got = report({"runs": runs})
    assert [r["minority_rounds"] for r in got["finishers"]] == [[], [], [2, 3]]
    assert got["finishers"][2]["downloads"] == ["1->2"] and got["finishers"][2]["last_line"] == "nobody serves it"
    assert (got["one_hash"], got["all_exit_0"], got["processes"], got["killed"]) == (False, False, 4, 1)
