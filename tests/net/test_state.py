"""State transfer between two SwarmAveragers (one process): a state streamed tensor by tensor into the
newcomer's own tensors, refused when it does not fit or is not what the swarm committed; and the
position decisions (behind, alone, finish) that use the DHT records."""

import threading
import time

import pytest
import torch
from conftest import fast_cfg
from hivemind.utils.timed_storage import get_dht_time

from swarm.config import FaultsConfig, OuterConfig, live_window
from swarm.errors import SwarmError
from swarm.net import schema, statesync
from swarm.net.dht import start_dht
from swarm.net.hostile import Hooks
from swarm.net.identity import load_identity
from swarm.net.peer import SwarmAverager
from swarm.net.policy import Verdict
from swarm.state.peerstate import destinations, served_tensors
from swarm.train.averaging import Intake, Snapshot
from swarm.train.diloco import DiLoCo, PseudoGradient

CFG = dict(progress_interval=0.2, stall_timeout=2.0)


class Peer:
    """A tiny model's DiLoCo state (a 4x4 linear layer, AdamW) with the averager's view of it."""

    def __init__(self, averager: SwarmAverager, seed: int):
        torch.manual_seed(seed)
        self.averager, self.model = averager, torch.nn.Linear(4, 4)
        self.diloco = DiLoCo(self.model, OuterConfig())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.step, self.batches = 0, torch.Generator().manual_seed(seed)  # two peers of one seed train alike

    def train_rounds(self, rounds: int) -> None:
        """Outer steps alone, each committed with its statement (a group of one), as a peer training alone signs."""
        for _ in range(rounds):
            self.model(torch.randn(2, 4, generator=self.batches)).sum().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.step += 1
            parent = self.diloco.global_sha256()
            self.diloco.outer_step(self.diloco.pseudo_gradient().tensors())
            self.averager.records.sign(self.diloco.round, parent, b"", 1)
            self.averager.offer_state(self.snapshot())

    def snapshot(self) -> Snapshot:
        return Snapshot(self.diloco.round, self.diloco.global_sha256(), {"round": self.diloco.round,
                        "step": self.step}, served_tensors(self.diloco), self.diloco.version,
                        lambda: self.diloco.version)

    def intake(self) -> Intake:
        def accept(meta, round):
            self.diloco.round, self.step = meta["round"], meta["step"]
            self.diloco.sync_local()
        return Intake(lambda specs: destinations(self.diloco, self.opt, specs), accept)

    def fetch(self, donors=None):
        """The trainer's catch-up: our state may change meanwhile (version, hash)."""
        with self.diloco.changing():
            return self.averager.fetch_state(self.intake(), self.diloco.round, self.diloco.global_sha256(), donors)

    def publish(self) -> None:
        self.averager.offer_state(self.snapshot(), wait=True)
        self.averager.publish_progress(self.diloco.round, 0, 0, 0.0, sha256=self.diloco.global_sha256(), wait=True)


def start_together(peers) -> None:
    """The peers start the run together: each sees the others live at outer step 0 (the run's founders, whose
    first certificates count for each other: swarm/net/certificates.py)."""
    for peer in peers:
        peer.publish()
    for peer in peers:
        peer.averager.records.assess(0, peer.diloco.global_sha256())


def _peers(bootstrap, names, seeds, faults=None):
    """Peers on a fresh bootstrap (`faults`: by name, a peer's FaultsConfig)."""
    cfg = fast_cfg(initial_peers=bootstrap, **CFG)
    dhts, averagers = [], []
    try:
        for name in names:
            identity = load_identity(None)
            dhts.append(start_dht(cfg, identity, fingerprint="fp"))
            averagers.append(SwarmAverager(cfg, dhts[-1], identity, "fp", name, faults=(faults or {}).get(name)))
        yield [Peer(averager, seed) for averager, seed in zip(averagers, seeds)]
    finally:
        for averager in averagers:
            averager.close()
        for dht in dhts:
            dht.shutdown()


@pytest.fixture
def pair(bootstrap):
    """A donor and a newcomer on a fresh bootstrap."""
    yield from _peers(bootstrap, ("donor", "newcomer"), (0, 1))


@pytest.fixture
def poisoner_honest_newcomer(bootstrap):
    """Two donors of one seed (they train alike, to one hash), the first a `poison-momentum` attacker, and a
    newcomer."""
    yield from _peers(bootstrap, ("poisoner", "honest", "newcomer"), (0, 0, 1),
                      {"poisoner": FaultsConfig(hostile=["poison-momentum"])})


@pytest.mark.timeout(60)
def test_a_newcomer_takes_the_committed_state_tensor_by_tensor(pair):
    donor, newcomer = pair
    newcomer.publish()
    assert newcomer.fetch() is None
    donor.train_rounds(3)
    donor.publish()
    got = newcomer.fetch()
    assert got.outer_step == 3 and newcomer.diloco.round == 3 and newcomer.step == 3
    assert got.bytes > sum(t.numel() * t.element_size() for t in served_tensors(donor.diloco).values())
    assert newcomer.diloco.global_sha256() == donor.diloco.global_sha256()
    mine, theirs = served_tensors(newcomer.diloco), served_tensors(donor.diloco)
    assert list(mine) == ["global.0", "global.1", "momentum.0", "momentum.1"]
    assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all(torch.equal(p, g) for p, g in zip(newcomer.diloco.params, newcomer.diloco.global_params))


@pytest.mark.timeout(60)
def test_a_newcomer_that_took_the_state_is_a_groupmate_at_once(pair):
    """Its record shows the round it took as soon as it holds it, before its first inner step: a peer matching
    for the next round waits for it instead of closing that round alone (which would send the newcomer, a round
    later, to download the state a second time)."""
    donor, newcomer = pair
    donor.train_rounds(2)
    donor.publish()
    assert newcomer.fetch().outer_step == 2
    position = donor.averager.records.assess(2, donor.diloco.global_sha256())
    assert position.verdict is Verdict.AVERAGE and position.expected_group == 2, position.note


def _download(newcomer: Peer, donor: Peer, check=lambda r, h: None) -> int:
    """One download straight from the donor, on the newcomer's network thread."""
    averager = newcomer.averager
    coro = statesync.download(averager.p2p, donor.averager.p2p.peer_id, averager.server.name, 2.0, 1e6,
                              newcomer.intake(), check, averager.pool)
    return averager.call(coro, 30).outer_step


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forgery", ["more bytes than the shape", "another shape", "another dtype",
                                     "bytes that do not hash", "a hash nobody committed"])
def test_a_forged_state_is_refused_naming_why(pair, forgery):
    donor, newcomer = pair
    donor.train_rounds(2)
    donor.publish()

    class Forges(Hooks):
        def manifest(self, manifest):
            specs = manifest["tensors"]
            if forgery == "more bytes than the shape":
                specs[0][3] += 4
            if forgery == "another shape":
                specs[0][2] = [8, 2]
            if forgery == "another dtype":
                specs[0][1], specs[0][3] = "bfloat16", specs[0][3] // 2
            return manifest
    donor.averager.server.hooks = Forges()
    if forgery == "bytes that do not hash":
        donor.averager.records.serving.tensors["global.0"].add_(1.0)  # changed after its hash was taken
    check = (lambda r, h: "the swarm committed another hash") if forgery == "a hash nobody committed" else None
    with pytest.raises(statesync.StateRefused) as refused:
        _download(newcomer, donor, check or (lambda r, h: None))
    expected = {"more bytes than the shape": "bytes announced", "another shape": "expected global.0",
                "another dtype": "expected global.0", "bytes that do not hash": "hash to",
                "a hash nobody committed": "the swarm committed another hash"}[forgery]
    assert expected in str(refused.value)


@pytest.mark.timeout(60)
def test_behind_with_no_donor_stops_naming_the_round_the_swarm_reached(pair):
    """A peer that knows the swarm committed a later round never trains on alone: with no donor it raises."""
    donor, newcomer = pair
    donor.train_rounds(4)
    donor.publish()
    donor.averager.records.withdraw_state()  # it stops serving, and leaves: its heartbeat stops
    donor.averager.records.close()
    newcomer.publish()
    time.sleep(live_window(donor.averager.cfg))  # gone: its commit record is what tells how far the swarm got
    start = time.monotonic()
    with pytest.raises(SwarmError, match="the swarm reached outer step 4 .* this peer holds outer step 0"):
        newcomer.fetch()
    assert time.monotonic() - start < 5 * 0.2 + 2 * 1.0 + 2.0 + 3.0  # live window + stall_timeout + slack


@pytest.mark.timeout(60)
def test_alone_and_behind(pair):
    donor, newcomer = pair
    grad = PseudoGradient([torch.ones(3), torch.zeros(2, 2)], [torch.zeros(3), torch.zeros(2, 2)])
    out = [torch.empty(3), torch.empty(2, 2)]
    donor.train_rounds(7)
    donor.publish()  # at round 7, serving it
    newcomer.averager.publish_progress(5, 0, 0, 0.0, sha256="d" * 64, wait=True)
    outcome = newcomer.averager.average(5, grad, 10, out, "d" * 64)  # the swarm is at round 7: take its state
    assert outcome.averaged is None and outcome.behind, outcome.note
    newcomer.averager.publish_progress(9, 0, 0, 0.0, sha256="e" * 64, wait=True)
    outcome = newcomer.averager.average(9, grad, 10, out, "e" * 64)  # nobody at round 9 or beyond: our own step
    assert outcome.note == "alone" and all(torch.equal(a, b) for a, b in zip(outcome.averaged, grad.tensors()))
    # Once it has averaged with others, a peer the records show alone does not wait in matchmaking for nobody.
    newcomer.averager.averaged_once = True
    newcomer.averager.matchmaker.form_group = lambda *args, **kwargs: pytest.fail("matchmaking while alone")
    newcomer.averager.publish_progress(10, 0, 0, 0.0, sha256="f" * 64, wait=True)
    outcome = newcomer.averager.average(10, grad, 10, out, "f" * 64)
    assert outcome.note == "alone" and all(torch.equal(a, b) for a, b in zip(outcome.averaged, grad.tensors()))
    bad = PseudoGradient([torch.zeros(1)], [torch.tensor([float("nan")])])  # the local model went NaN
    assert "not finite" in newcomer.averager.average(9, bad, 10, [torch.empty(1)], "e" * 64).note


@pytest.mark.timeout(60)
def test_a_finished_peer_serves_its_state_until_peers_behind_caught_up(pair):
    donor, newcomer = pair
    donor.train_rounds(3)
    donor.publish()
    newcomer.publish()  # at round 0, training round 1
    start = time.monotonic()
    finisher = threading.Thread(target=donor.averager.finish, args=(3, donor.diloco.global_sha256()))
    finisher.start()
    time.sleep(2.0)  # the laggard learns it is behind only after its next matchmaking
    assert finisher.is_alive(), "the finished peer left while a live peer was behind"
    assert newcomer.fetch().outer_step == 3
    newcomer.publish()  # caught up: nobody is behind any more
    finisher.join(10)
    assert not finisher.is_alive() and time.monotonic() - start < 2.0 + 5.0
    start = time.monotonic()
    donor.averager.finish(3, donor.diloco.global_sha256())  # nobody behind: leaves at once
    assert time.monotonic() - start < 3.0  # far below linger_time (60 s)

    # A peer killed at round 1: its record has not expired, but it stopped changing (no heartbeat).
    ghost = load_identity(None)
    ghost_dht = start_dht(donor.averager.cfg, ghost)
    try:
        now = get_dht_time()
        record = schema.ProgressRecord(peer_id=str(ghost.peer_id), name="ghost", round=1, inner_step=0, samples=0,
                                       samples_per_s=0.0, time=now - 60, serves_state=True, ready=False)
        assert ghost_dht.store(schema.progress_key(donor.averager.cfg.run_id), record.dict(), subkey=ghost.owner,
                               expiration_time=now + 30)
    finally:
        ghost_dht.shutdown()
    assert "ghost" in [r.name for r in donor.averager.records.peers()]
    start = time.monotonic()
    donor.averager.finish(3, donor.diloco.global_sha256())
    assert time.monotonic() - start < 3.0


@pytest.mark.timeout(60)
def test_a_run_that_ends_split_in_two_halves_ends_on_one_hash(pair):
    """Two peers end the run at the same outer step on two hashes (a last round split between two groups of one):
    by the quorum rule the larger hash wins the tie on both sides, so the other peer's `finish` names the winner
    as its donor, and the winner stays (serving) until the loser has taken its state."""
    a, b = pair
    start_together(pair)
    a.train_rounds(3)
    b.train_rounds(3)
    a.publish()
    b.publish()
    winner, loser = sorted((a, b), key=lambda p: p.diloco.global_sha256(), reverse=True)
    done = []
    stays = threading.Thread(target=lambda: done.append(winner.averager.finish(3, winner.diloco.global_sha256())))
    stays.start()
    donors = loser.averager.finish(3, loser.diloco.global_sha256())
    assert donors == [winner.averager.peer_id]
    time.sleep(1.0)
    assert stays.is_alive(), "the winner left while the loser still held the other hash"
    with loser.diloco.changing():
        got = loser.averager.fetch_state(loser.intake(), 3, loser.diloco.global_sha256(), donors)
    assert got is not None and loser.diloco.global_sha256() == winner.diloco.global_sha256()
    loser.publish()
    stays.join(15)
    assert not stays.is_alive() and done == [None]
    assert loser.averager.finish(3, loser.diloco.global_sha256()) is None  # one hash now: nothing to take


@pytest.mark.timeout(30)
def test_expected_group_counts_peers_not_yet_reported_at_the_round(pair):
    """A peer whose record still shows the round before may be about to average this one: a group that
    closed without it would split the round (seen with records published only when ready)."""
    donor, newcomer = pair
    newcomer.averager.publish_progress(5, 0, 0, 0.0, wait=True)
    for donor_round, expected in ((5, 2), (4, 2), (3, 1)):
        donor.averager.publish_progress(donor_round, 0, 0, 0.0, wait=True)
        assert newcomer.averager.records.assess(5, "", commits=False).expected_group == expected, donor_round


def test_state_names_and_the_intake_refuse_a_model_of_another_shape():
    ours = DiLoCo(torch.nn.Linear(4, 4), OuterConfig())
    theirs = DiLoCo(torch.nn.Linear(4, 3), OuterConfig())
    opt = torch.optim.AdamW(ours.model.parameters())
    from swarm.state.peerstate import TensorSpec
    specs = [TensorSpec.of(f"global.{i}", g) for i, g in enumerate(theirs.global_params)]
    with pytest.raises(ValueError, match="global.0 float32 \\[3, 4\\], expected global.0 float32 \\[4, 4\\]"):
        destinations(ours, opt, specs)


@pytest.mark.timeout(60)
def test_a_peer_on_the_minority_s_parameters_takes_the_majority_s_state_at_once(pair):
    """Two peers committed round 3 on different parameters (a split commit): the side that loses the vote
    (one each: the larger hash wins, on both sides) learns it before averaging and takes the other's state."""
    one, other = pair
    start_together(pair)
    one.train_rounds(3)
    other.train_rounds(3)
    for peer in pair:
        peer.publish()
    winner, loser = sorted(pair, key=lambda p: p.diloco.global_sha256(), reverse=True)
    outcome = loser.averager.average(3, loser.diloco.pseudo_gradient(), 1, loser.diloco.outer_grads(),
                                     loser.diloco.global_sha256())
    assert outcome.averaged is None and outcome.behind and outcome.donors == [winner.averager.peer_id], outcome.note
    assert loser.fetch().outer_step == 3 and loser.diloco.global_sha256() == winner.diloco.global_sha256()


@pytest.mark.timeout(60)
def test_a_refused_state_is_logged_naming_the_donor_and_the_next_attempt_is_made(pair, caplog):
    """The donor's first answer announces more bytes than its first tensor holds: refused with a line naming
    the donor; the newcomer tries again and takes the honest answer."""
    import logging

    donor, newcomer = pair
    donor.train_rounds(2)
    donor.publish()
    newcomer.publish()

    class ForgesOnce(Hooks):
        forged = False

        def manifest(self, manifest):
            if not self.forged:
                self.forged = True
                manifest["tensors"][0][3] += 4
            return manifest
    donor.averager.server.hooks = ForgesOnce()
    with caplog.at_level(logging.WARNING, logger="swarm.net.peer"):
        assert newcomer.fetch().outer_step == 2
    assert f"state from {donor.averager.peer_id} refused" in caplog.text and "bytes announced" in caplog.text
    assert newcomer.diloco.global_sha256() == donor.diloco.global_sha256()


@pytest.mark.timeout(90)
def test_a_donor_serving_poisoned_momentum_under_its_hash_is_refused_by_name_and_an_honest_one_taken(
        poisoner_honest_newcomer, caplog):
    """`poison-momentum` (hostile.py): the poisoner serves its real global parameters and committed hash, and its
    outer momentum times -10. The state's hash covers the momentum (swarm/state/statehash.py), so the newcomer refuses
    it as forged, naming the poisoner, charges it, and takes the honest donor's state: its momentum is the one
    the swarm committed."""
    import logging

    poisoner, honest, newcomer = poisoner_honest_newcomer
    for donor in (poisoner, honest):
        donor.train_rounds(2)
        donor.publish()
    assert poisoner.diloco.global_sha256() == honest.diloco.global_sha256()  # one committed hash at round 2
    newcomer.publish()
    ids = [p.averager.peer_id for p in (poisoner, honest)]
    with caplog.at_level(logging.WARNING, logger="swarm.net.peer"):
        got = newcomer.fetch(donors=ids)  # the poisoner first
    assert got.donor == honest.averager.peer_id and got.outer_step == 2
    refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"state from {ids[0]} refused")]
    assert refused and "outer momentum" in refused[0] and "hash to" in refused[0], caplog.text
    assert not any(r.getMessage().startswith(f"state from {ids[1]} refused") for r in caplog.records)
    assert newcomer.diloco.global_sha256() == honest.diloco.global_sha256()
    assert all(torch.equal(m, h) for m, h in zip(newcomer.diloco.momentum_buffers(), honest.diloco.momentum_buffers()))
