"""offer_state / fetch_state between two SwarmAveragers (one process) and progress-based decisions."""

import pytest
import torch
from conftest import fast_cfg

from swarm.net.dht import start_dht
from swarm.net.peer import SwarmAverager


@pytest.fixture(scope="module")
def pair(bootstrap_module):
    cfg = fast_cfg(initial_peers=bootstrap_module)
    dhts, averagers = [], []
    try:
        for name in ("donor", "newcomer"):
            dhts.append(start_dht(cfg, fingerprint="fp"))
            averagers.append(SwarmAverager(cfg, dhts[-1], "fp", name))
        yield averagers
    finally:
        for averager in averagers:
            averager.close()
        for dht in dhts:
            dht.shutdown()


@pytest.fixture(scope="module")
def bootstrap_module():
    dht = start_dht(fast_cfg())
    try:
        from swarm.net.dht import visible_maddrs
        yield visible_maddrs(dht)
    finally:
        dht.shutdown()


def fits(state):
    if state["w"].shape != (4, 4):
        raise ValueError(f"w has shape {tuple(state['w'].shape)}")


@pytest.mark.timeout(60)
def test_state_round_trip_then_refusals(pair):
    donor, newcomer = pair
    assert newcomer.fetch_state(-1, fits) is None  # nobody offers anything yet
    state = {"round": 3, "w": torch.randn(4, 4), "meta": {"lr": 0.5}}
    donor.offer_state(3, state)
    donor.publish_progress(4, 0, 0, 0.0)
    got = newcomer.fetch_state(2, fits)
    assert got is not None and torch.equal(got["w"], state["w"]) and got["meta"] == {"lr": 0.5}
    assert newcomer.fetch_state(4, fits) is None  # not newer than what we have
    donor.offer_state(3, {"round": 3, "w": torch.randn(2, 2)})  # does not fit this peer's model
    assert newcomer.fetch_state(2, fits) is None
    round_, blob, digest = donor._offered
    donor._offered = (round_, blob[:-1] + bytes([blob[-1] ^ 1]), digest)  # corrupted after its checksum
    assert newcomer.fetch_state(2, fits) is None


@pytest.mark.timeout(60)
def test_alone_and_behind(pair):
    donor, newcomer = pair
    grad = [torch.ones(3), torch.zeros(2, 2)]
    donor.publish_progress(7, 0, 0, 0.0)
    outcome = newcomer.average(5, grad, 10)  # the swarm is at round 7: fetch the state instead
    assert outcome.averaged is None and outcome.behind, outcome.note
    outcome = newcomer.average(9, grad, 10)  # nobody at round 9 or beyond: apply our own step
    assert outcome.note == "alone" and all(torch.equal(a, b) for a, b in zip(outcome.averaged, grad))
    bad = newcomer.average(9, [torch.tensor([float("nan")])], 10)
    assert bad.averaged is None and "not finite" in bad.note


@pytest.mark.timeout(60)
def test_a_finished_peer_serves_its_state_until_peers_behind_caught_up(pair):
    import threading
    import time

    donor, newcomer = pair
    donor.offer_state(12, {"round": 12, "w": torch.ones(4, 4)})
    newcomer.publish_progress(10, 0, 0, 0.0)  # still training round 11
    start = time.monotonic()
    finisher = threading.Thread(target=donor.finish, args=(12,))
    finisher.start()
    time.sleep(3.0)  # the laggard learns it is behind only after its next matchmaking
    assert finisher.is_alive(), "the finished peer left while a live peer was behind"
    got = newcomer.fetch_state(10, fits)
    assert got is not None and torch.equal(got["w"], torch.ones(4, 4))
    newcomer.publish_progress(12, 0, 0, 0.0)  # caught up: nobody is behind any more
    finisher.join(10)
    assert not finisher.is_alive() and time.monotonic() - start < 3.0 + 5.0
    start = time.monotonic()
    donor.finish(12)  # nobody behind: leaves at once
    assert time.monotonic() - start < 4.0  # far below linger_time (60 s)

    # A peer killed at round 3: its record has not expired, but it stopped changing (no heartbeat).
    from hivemind.utils.timed_storage import get_dht_time

    from swarm.net import schema
    now, ghost = get_dht_time(), "12D3KooWGhostGhostGhostGhostGhostGhostGhostGhost1234"
    record = schema.ProgressRecord(peer_id=ghost, name="ghost", round=3, inner_step=0, samples=0, samples_per_s=0.0,
                                   time=now - 60, serves_state=True, ready=False)
    assert newcomer.dht.store(schema.progress_key("swarm-tiny"), record.dict(), subkey=ghost,
                              expiration_time=now + 30)
    assert "ghost" in [r.name for r in donor.peers()]
    start = time.monotonic()
    donor.finish(12)
    assert time.monotonic() - start < 4.0  # far below linger_time (60 s)


@pytest.mark.timeout(30)
def test_expected_group_counts_peers_not_yet_reported_at_the_round(pair):
    """A peer whose record still shows the round before may be about to average this one: a group that
    closed without it would split the round (seen with records published only when ready)."""
    donor, newcomer = pair
    newcomer.publish_progress(5, 0, 0, 0.0)
    assert newcomer._expected_group(5) is None  # before its first group: wait the full matchmaking_time
    newcomer._averaged_once = True
    for donor_round, expected in ((5, 2), (4, 2), (3, 1)):
        donor.publish_progress(donor_round, 0, 0, 0.0)
        assert newcomer._expected_group(5) == expected, donor_round
