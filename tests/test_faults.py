"""Faults with real processes on loopback: kill -9 in the all-reduce, join, crash + restart, SIGTERM,
a slow peer, a full swarm restart. In each: live peers agree on every round's hash, rounds keep coming,
and no round takes longer than its time-out plus slack."""

import json
import signal
import time

import pytest

from swarm.net.budget import outer_step_deadline
from swarm.run.configfile import load_config
from swarm.state.checkpoint import Checkpointer
from tests.conftest import ROOT
from tests.swarm_harness import SMALL, local_swarm

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)

# A round's deadline with SMALL's time-outs (matchmaking 3 s, requests 1 s, stall 5 s) for a tiny vector:
# three attempts of 3 + 1 + 5 s (budget.outer_step_deadline).
ROUND_TIMEOUT = outer_step_deadline(0, load_config(ROOT / "configs" / "tiny.yaml", SMALL).swarm)
SLACK = 30.0  # inner steps, eval and checkpointing of one round on a loaded 2-core machine


def assert_rounds_agree(summaries: list[dict], rounds: int) -> None:
    """Every round 1..rounds was committed by someone, with one hash; no round outlasted its time-out."""
    hashes: dict[int, set] = {}
    for p in summaries:
        for record in p["rounds"]:
            assert record["comm_s"] < ROUND_TIMEOUT + SLACK, f"{p['name']} round {record['round']} took too long"
            if record["committed"]:
                hashes.setdefault(record["round"], set()).add(record["global_sha256"])
    assert sorted(hashes) == list(range(1, rounds + 1))
    for r, seen in hashes.items():
        assert len(seen) == 1, f"round {r}: peers hold different global parameters"
    assert len({p["final_global_sha256"] for p in summaries}) == 1


def two_peers(swarm, rounds: int, *b_faults: str, a_faults: tuple[str, ...] = ()):
    """Peers a (shard 0) and b (shard 1, with `b_faults` overrides) of one group of 2; returns (a, b, args)."""
    args = ["--diloco.rounds", str(rounds), "--diloco.inner_steps", "6", "--swarm.target_group_size", "2"]
    swarm.start_bootstrap()
    a = swarm.start_peer("a", *args, "--data.shard", "0", *a_faults)
    return a, swarm.start_peer("b", *args, "--data.shard", "1", *b_faults), args


def read_status(child) -> dict:
    try:
        return json.loads((child.out_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay, fragments", [(0, 1), (4, 2)])
def test_local_swarm_kill_inside_allreduce_and_join(tmp_path, delay, fragments, swarm_cmd):
    """The issue's demo, shrunk: `swarm local --kill 1@2:allreduce --join 2`, blocking, and with overlap on: two
    fragments exchanged in turn, each behind the next 4 inner steps (diloco.delay; the round's closing exchange
    runs behind the next round's, as with one fragment). The kill falls inside round 2's closing exchange; the
    joiner may take a mid-round state."""
    result = swarm_cmd("local", "--config", "configs/tiny.yaml", "--peers", "3", "--rounds", "4",
                       "--kill", "1@2:allreduce", "--join", "2", "--out", str(tmp_path), *SMALL,
                       "--diloco.inner_steps", "10", "--faults.step_delay", "0.2", "--diloco.delay", str(delay),
                       "--diloco.fragments", str(fragments), timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    kinds = [e["event"] for e in summary["events"]]
    assert "kill" in kinds and "join" in kinds and "state_downloaded" in kinds
    live = summary["peers"]
    assert sorted(p["name"] for p in live) == ["peer-0", "peer-2", "peer-3"]  # peer-3 is the joiner
    assert all(p["rounds_completed"] == 4 for p in live)
    assert_rounds_agree(live, 4)
    evals = live[0]["eval_loss"]
    assert evals[-1] < evals[0] < live[0]["initial_eval_loss"]
    assert summary["fault_report"]["kill peer-1"]["s_to_next_committed_round"] < ROUND_TIMEOUT + SLACK


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoint, delay", [("intact", 4), ("corrupt", 0)])
def test_crash_and_restart_resumes_and_catches_up(tmp_path, checkpoint, delay, fork_server):
    """b dies in round 3 and restarts on its folder; a holds before round 4 until b is back (a restart takes
    seconds, a tiny round less: without the hold a could finish all rounds first, and b rightly stop). With
    overlap on (delay 4 of 6 inner steps) b dies at inner step 3 of round 3, round 2's exchange still in flight:
    its checkpoint holds round 1, and it catches up from a."""
    hold = tmp_path / "hold-a"
    hold.touch()
    with local_swarm(tmp_path, fork_server) as swarm:
        a, b, args = two_peers(swarm, 5, "--faults.kill_round", "3", "--diloco.delay", str(delay),
                               a_faults=("--faults.hold_round", "4", "--faults.hold_file", str(hold),
                                         "--diloco.delay", str(delay)))
        b.proc.wait(timeout=200)
        assert b.proc.returncode == -signal.SIGKILL
        saved = Checkpointer(tmp_path / "b" / "checkpoint").latest()
        assert saved is not None
        if checkpoint == "corrupt":
            (saved / "global.safetensors").write_bytes((saved / "global.safetensors").read_bytes()[:1000])
        (tmp_path / "b" / "status.json").unlink()  # b2 writes its own
        b2 = swarm.start_peer("b", *args, "--data.shard", "1", "--diloco.delay", str(delay))  # resume, catch up
        deadline = time.time() + 120
        while read_status(b2).get("state") != "training" and b2.proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        hold.unlink()
        swarm.wait([a, b2], timeout=240)
        assert a.proc.returncode == 0 and b2.proc.returncode == 0, swarm.log(b2)[-3000:]
        log = swarm.log(b2)
        if checkpoint == "intact":
            assert "resumed from" in log
            assert not delay or " at round 1 (" in log  # round 2 had not landed: its checkpoint is round 1's
        else:
            assert "corrupt checkpoint" in log and "falling back to the state of peers" in log
            assert "fetched the state of outer step" in log
        summaries = [swarm.summary(a), swarm.summary(b2)]
    assert_rounds_agree(summaries, 5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [0, 4])
def test_sigterm_leaves_cleanly_and_the_rest_carry_on(tmp_path, delay, fork_server):
    """With overlap on, the leaver may stop with an exchange in flight: it checkpoints its last committed round."""
    with local_swarm(tmp_path, fork_server) as swarm:
        swarm.start_bootstrap()
        args = ["--diloco.rounds", "4", "--diloco.inner_steps", "6", "--swarm.target_group_size", "3",
                "--diloco.delay", str(delay)]
        peers = [swarm.start_peer(f"p{i}", *args, "--data.shard", str(i)) for i in range(3)]
        leaver = peers[2]
        deadline = time.time() + 150
        while time.time() < deadline:  # wait until it committed a round, then ask it to leave
            if read_status(leaver).get("round", 0) >= 1:
                break
            time.sleep(0.3)
        leaver.proc.send_signal(signal.SIGTERM)
        leaver.proc.wait(timeout=30)
        assert leaver.proc.returncode == 128 + signal.SIGTERM, swarm.log(leaver)[-2000:]
        assert "swarm: stopped by SIGTERM" in swarm.log(leaver)
        assert Checkpointer(leaver.out_dir / "checkpoint").latest() is not None
        assert (leaver.out_dir / "peer.json").exists()
        assert json.loads((leaver.out_dir / "summary.json").read_text())["peers"][0]["rounds_completed"] >= 1
        swarm.wait(peers[:2], timeout=240)
        assert all(p.proc.returncode == 0 for p in peers[:2])
        summaries = [swarm.summary(p) for p in peers[:2]]
    assert_rounds_agree(summaries, 4)


@pytest.mark.timeout(300)
def test_slow_peer_contributes_the_steps_it_has(tmp_path, fork_server):
    with local_swarm(tmp_path, fork_server) as swarm:
        swarm.start_bootstrap()
        args = ["--diloco.rounds", "3", "--diloco.inner_steps", "8", "--swarm.target_group_size", "2",
                "--logging.dump_tensors", "true"]
        fast = swarm.start_peer("fast", *args, "--data.shard", "0")
        slow = swarm.start_peer("slow", *args, "--data.shard", "1", "--faults.step_delay", "1.0")
        swarm.wait([fast, slow], timeout=240)
        assert fast.proc.returncode == 0 and slow.proc.returncode == 0, swarm.log(slow)[-3000:]
        summaries = [swarm.summary(fast), swarm.summary(slow)]
        slow_dumps = swarm.dumps(slow)
    assert_rounds_agree(summaries, 3)
    assert all(r["group_size"] == 2 for s in summaries for r in s["rounds"])  # nobody was left out
    assert any(d["samples"] < 8 * 8 for d in slow_dumps)  # it stopped early with fewer samples


@pytest.mark.timeout(300)
def test_full_swarm_restart_continues_from_the_last_round(tmp_path, fork_server):
    args = ["--diloco.inner_steps", "5", "--swarm.target_group_size", "2"]
    with local_swarm(tmp_path, fork_server) as swarm:
        swarm.start_bootstrap()
        first = [swarm.start_peer(f"p{i}", *args, "--diloco.rounds", "2", "--data.shard", str(i)) for i in range(2)]
        swarm.wait(first, timeout=200)
        assert all(p.proc.returncode == 0 for p in first)
        before = [swarm.summary(p) for p in first]
    with local_swarm(tmp_path / "again", fork_server) as swarm:
        swarm.start_bootstrap()  # a brand-new DHT: nothing to download, only checkpoints
        again = [swarm.start_peer(f"p{i}", *args, "--diloco.rounds", "4", "--data.shard", str(i),
                                  "--checkpoint.dir", str(tmp_path / f"p{i}" / "checkpoint")) for i in range(2)]
        swarm.wait(again, timeout=200)
        assert all(p.proc.returncode == 0 for p in again), swarm.log(again[0])[-3000:]
        after = [swarm.summary(p) for p in again]
    assert all(p["rounds_completed"] == 4 for p in after)
    assert after[0]["round_hashes"][:2] == before[0]["round_hashes"]
    assert_rounds_agree(after, 4)


@pytest.mark.timeout(300)
def test_a_peer_restarted_after_the_swarm_finished_stops_instead_of_forking(tmp_path, fork_server):
    """Killed in round 2's all-reduce, restarted on its folder once the others finished round 4: its checkpoint
    holds round 1 (round 2's was begun only once round 1's was in place), the swarm's commit records say round 4,
    nobody serves it any more. It must exit 1 naming the round, never train rounds 2-4 alone and exit 0 on a hash
    the swarm did not commit."""
    with local_swarm(tmp_path, fork_server) as swarm:
        a, b, args = two_peers(swarm, 4, "--faults.kill_round", "2", "--faults.kill_phase", "allreduce")
        swarm.wait([a, b], timeout=240)
        assert b.proc.returncode == -signal.SIGKILL and a.proc.returncode == 0, swarm.log(a)[-3000:]
        assert swarm.summary(a)["rounds_completed"] == 4
        start = time.monotonic()
        b2 = swarm.start_peer("b", *args, "--data.shard", "1")  # same folder: resumes at round 1
        swarm.wait([b2], timeout=120)
        log = swarm.log(b2)
    assert b2.proc.returncode == 1, log[-3000:]
    assert "resumed from" in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("swarm: error: the swarm reached outer step 4") and "this peer holds outer step 1" in last, last
    assert "round 2 committed" not in log  # it never trained on alone
    # bounded: the live window (5 x 1 s + 2 x 1 s) and stall_timeout (5 s) after start-up, plus slack
    assert time.monotonic() - start < 60


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [0, 4])
def test_a_peer_whose_model_goes_nan_takes_the_swarm_s_state(tmp_path, delay, fork_server):
    """b's local model turns NaN in round 2: it stops announcing readiness, takes a's state of round 1 and
    trains on; both end on one hash, and no round ever averaged a NaN. With overlap on, round 1's exchange
    is still in flight when the model turns NaN (inner step 3) and lands (step 4) on the NaN local model."""
    with local_swarm(tmp_path, fork_server) as swarm:
        a, b, _ = two_peers(swarm, 4, "--faults.nan_round", "2", "--diloco.delay", str(delay),
                            a_faults=("--diloco.delay", str(delay)))
        swarm.wait([a, b], timeout=240)
        assert a.proc.returncode == 0 and b.proc.returncode == 0, swarm.log(b)[-3000:]
        log = swarm.log(b)
        summaries = [swarm.summary(a), swarm.summary(b)]
    assert "the local model is not finite" in log and "this peer was at round 1)" in log
    assert [e["event"] for e in summaries[1]["events"]].count("non_finite_model") == 1
    assert_rounds_agree(summaries, 4)


def test_a_solo_peer_whose_model_goes_nan_stops_with_one_line(tmp_path, swarm_cmd):
    result = swarm_cmd("peer", "--config", "configs/tiny.yaml", "--solo", "--out", str(tmp_path), *SMALL,
                       "--diloco.rounds", "2", "--diloco.inner_steps", "4", "--faults.nan_round", "2")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == ("swarm: error: round 2: the local model is not finite and "
                                                      "there is no peer to take a state from (this peer runs "
                                                      "without a swarm)")
