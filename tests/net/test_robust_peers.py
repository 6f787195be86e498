"""Real peers in separate processes with bounded influence on: a 1e6x pseudo-gradient, a weight claim of 1e18
and a part owner returning a wrong average, each against the value the rule predicts."""

import pytest
import torch
from peer_proc import make_vector
from test_allreduce_peers import check_identical_mean

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)

MEET = dict(matchmaking_time=6.0)  # all three must meet in one group: a leader waits up to 6 s for a late peer


def run_three(bootstrap, peers, hostile_mode: str, samples=(5, 5, 5), numel=30_000, **cfg) -> tuple[list, list]:
    jobs = [peers.start("hostile", bootstrap, seed=0, samples=samples[0], numel=numel, mode=hostile_mode,
                        **MEET, **cfg)]
    jobs += [peers.start(f"p{i}", bootstrap, seed=i, samples=samples[i], numel=numel, **MEET, **cfg) for i in (1, 2)]
    peers.go()
    return jobs, [peers.wait(job, 100) for job in jobs]


def check_all(peers, results, want: list[torch.Tensor], tol: float) -> None:
    first = results[0]["outcome"]["averaged"]
    for result in results:
        outcome = result["outcome"]
        assert outcome["averaged"] is not None and outcome["group_size"] == 3, outcome["note"] + "\n" + peers.logs()
        for got, ref, exp in zip(outcome["averaged"], first, want):
            assert torch.equal(got, ref), "results differ between peers"
            assert (got - exp).abs().max().item() <= tol


@pytest.mark.timeout(150)
def test_a_1e6x_pseudo_gradient_is_trimmed_away(bootstrap, peers):
    """trimmed_mean of 3 equal weights is the coordinate-wise median; the plain mean would be ~3e5 x."""
    jobs, results = run_three(bootstrap, peers, "huge", aggregation="trimmed_mean")
    vectors = [make_vector(j["seed"], j["numel"]) for j in jobs]
    vectors[0] = [t * 1e6 for t in vectors[0]]
    want = [torch.stack([v[k] for v in vectors]).median(0).values for k in range(2)]
    check_all(peers, results, want, tol=1e-5)


@pytest.mark.timeout(150)
def test_a_weight_claim_of_1e18_gets_the_capped_share(bootstrap, peers):
    """max_weight_share 0.5: shares 0.5, 0.25, 0.25 instead of 1, 0, 0."""
    jobs, results = run_three(bootstrap, peers, "heavy", max_weight_share=0.5)
    vectors = [make_vector(j["seed"], j["numel"]) for j in jobs]
    want = [0.5 * vectors[0][k] + 0.25 * vectors[1][k] + 0.25 * vectors[2][k] for k in range(2)]
    check_all(peers, results, want, tol=1e-5)


@pytest.mark.timeout(150)
def test_a_wrong_average_is_caught_and_its_owner_left_out(bootstrap, peers):
    """The hostile owner adds 1.0 to its part's average. Each honest peer's audit names it; the round is
    retried without it, and the two honest peers end with exactly their own mean. The hostile runs one round:
    when it got every honest part before their audits failed the round, it leaves with its own result and the
    honest pair regroups without it; otherwise it retries, meets them again, and they leave it out by name."""
    jobs, results = run_three(bootstrap, peers, "wrong_owner", verify_parts=True)
    hostile_id, hostile = results[0]["peer_id"], results[0]["outcome"]
    came_back = hostile["averaged"] is None or hostile["group_size"] != 3
    check_identical_mean(peers, results[1:], jobs[1:], tol=1e-6)
    for job in jobs[1:]:
        log = peers.log(job, None)
        assert f"owner {hostile_id} returned a wrong average" in log, peers.logs()
        if came_back:
            assert "leaving out offenders" in log and hostile_id in log.split("leaving out offenders")[1][:200]
