"""Real peers in separate processes on 127.0.0.1: averaging results, a killed peer, a NaN sender."""

import time
from pathlib import Path

import pytest
import torch
from conftest import fast_cfg
from peer_proc import make_vector

from swarm.net import budget

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)


def expected_mean(jobs: list[dict]) -> list[torch.Tensor]:
    total = sum(j["samples"] for j in jobs)
    vectors = [make_vector(j["seed"], j["numel"]) for j in jobs]
    return [sum(v[i] * j["samples"] for v, j in zip(vectors, jobs)) / total for i in range(2)]


def check_identical_mean(peers, results: list[dict], jobs: list[dict], tol: float) -> None:
    want = expected_mean(jobs)
    first = results[0]["outcome"]["averaged"]
    for result in results:
        outcome = result["outcome"]
        assert outcome["averaged"] is not None, outcome["note"] + "\n" + peers.logs()
        assert outcome["group_size"] == len(jobs)
        assert outcome["total_samples"] == sum(j["samples"] for j in jobs)
        for got, ref, exp in zip(outcome["averaged"], first, want):
            assert got.shape == exp.shape
            assert torch.equal(got, ref), "results differ between peers"
            assert (got - exp).abs().max().item() <= tol


@pytest.mark.timeout(90)
def test_three_peers_fp32_identical_weighted_mean(bootstrap, peers):
    jobs = [peers.start(f"p{i}", bootstrap, seed=i, samples=s, numel=1_000_000)
            for i, s in enumerate([10, 20, 70])]
    peers.go()
    results = [peers.wait(job, 60) for job in jobs]
    check_identical_mean(peers, results, jobs, tol=1e-6)
    print("all-reduce of 1M fp32 among 3 peers, seconds:", [round(r["allreduce_s"][-1], 3) for r in results])


@pytest.mark.timeout(90)
def test_three_peers_fp16_with_stock_hivemind_dht_bootstrap(stock_bootstrap, peers):
    jobs = [peers.start(f"p{i}", stock_bootstrap, seed=10 + i, samples=s, numel=100_000, compression="fp16")
            for i, s in enumerate([1, 2, 3])]
    peers.go()
    results = [peers.wait(job, 60) for job in jobs]
    check_identical_mean(peers, results, jobs, tol=2e-3)  # |x| < ~5: fp16 in and out, ~1e-3 absolute


@pytest.mark.timeout(120)
def test_peer_killed_mid_allreduce_survivors_do_not_hang(bootstrap, peers):
    stall = 5.0
    victim = peers.start("victim", bootstrap, seed=0, samples=1, numel=300_000, mode="victim", stall_timeout=stall)
    jobs = [peers.start(f"p{i}", bootstrap, seed=i, samples=1, numel=300_000, stall_timeout=stall) for i in (1, 2)]
    outer_step_deadline = budget.outer_step_deadline(2 * 4 * 300_000, fast_cfg(stall_timeout=stall))
    peers.go()
    deadline = time.monotonic() + 40
    while not Path(victim["marker"]).exists():
        assert time.monotonic() < deadline, "the victim never reached its all-reduce:\n" + peers.log(victim)
        time.sleep(0.02)
    killed_at = time.monotonic()
    peers.kill(victim)
    results = [peers.wait(job, 60) for job in jobs]
    outcomes = [r["outcome"] for r in results]
    # each survivor's first all-reduce (the one with the victim) stalled out within stall_timeout + slack
    for result in results:
        assert result["allreduce_s"][0] <= stall + 2.0
    assert time.monotonic() - killed_at < outer_step_deadline + 10.0  # bounded by the round's deadline, never a hang
    done = [o for o in outcomes if o["averaged"] is not None]
    if len(done) == 2:  # the survivors retried together: identical, and exactly their mean
        check_identical_mean(peers, results, jobs, tol=1e-6)
    assert peers.group_gone(victim, timeout=10), "the killed peer left processes behind"
    for outcome in outcomes:
        print(outcome["note"], outcome["group_size"], round(outcome["comm_s"], 2))
    print("survivors' all-reduce attempts, s:", [r["allreduce_s"] for r in results])


@pytest.mark.timeout(150)
def test_nan_sender_is_rejected_never_averaged(bootstrap, peers):
    # All three meet first (a leader waits up to 6 s for a peer the loaded machine made late). The hostile peer
    # gives up its round after 3 x (6 + 1 + 1) s; the others retry until they average without it.
    hostile = peers.start("hostile", bootstrap, seed=0, samples=1000, numel=50_000, mode="nan", stall_timeout=1.0,
                          matchmaking_time=6.0)
    jobs = [peers.start(f"p{i}", bootstrap, seed=i, samples=5, numel=50_000, stall_timeout=8.0, matchmaking_time=6.0)
            for i in (1, 2)]
    peers.go()
    results = [peers.wait(job, 100) for job in jobs]
    hostile_outcome = peers.wait(hostile, 30)["outcome"]
    # never averaged with anyone: discarded, or left out by both (grouping.Offenses) and alone with its own step
    assert hostile_outcome["averaged"] is None or hostile_outcome["note"] == "alone", hostile_outcome["note"]
    check_identical_mean(peers, results, jobs, tol=1e-6)  # exactly the honest mean: the NaN never got in
    hostile_id = peers.wait(hostile, 1)["peer_id"]
    assert f"rejected the contribution of {hostile_id}" in peers.log(jobs[0], None) + peers.log(jobs[1], None)


@pytest.mark.timeout(90)
def test_groupmates_on_other_global_parameters_never_average_together(bootstrap, peers):
    """Two peers on base A, one on base B: A's average without B; B is told to take A's state."""
    # all three must meet in one group: a leader waits up to 6 s for a peer the loaded machine made late
    jobs = [peers.start(f"p{i}", bootstrap, seed=i, samples=s, numel=10_000, base=b, matchmaking_time=6.0)
            for i, (s, b) in enumerate([(1, "a" * 64), (3, "a" * 64), (5, "b" * 64)])]
    peers.go()
    results = [peers.wait(job, 60) for job in jobs]
    check_identical_mean(peers, results[:2], jobs[:2], tol=1e-6)
    other = results[2]["outcome"]
    assert other["averaged"] is None and other["behind"], other["note"] + "\n" + peers.logs()
    assert sorted(other["donors"]) == sorted(r["peer_id"] for r in results[:2])


@pytest.mark.timeout(90)
def test_a_member_that_leaves_right_after_its_last_round_still_serves_its_part(bootstrap, peers):
    """The fast member exits as soon as average() returns; the slow one must still get its part."""
    jobs = [peers.start("fast", bootstrap, seed=1, samples=1, numel=50_000),
            peers.start("slow", bootstrap, seed=2, samples=1, numel=50_000, mode="slow_fetch")]
    peers.go()
    results = [peers.wait(job, 60) for job in jobs]
    check_identical_mean(peers, results, jobs, tol=1e-6)
