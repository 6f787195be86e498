"""diloco.fragments / diloco.mix_alpha (Streaming DiLoCo): the partition rule, the schedule against a hand-written
reference, discarded fragment exchanges, and what is refused."""

import pytest
import torch

from peers.local_trainers import simulate
from swarm.config import ConfigError
from swarm.data.batches import TrainBatches, load_corpus
from swarm.state.peerstate import TensorSpec
from swarm.train.averaging import Download, ExchangeOutcome, SoloAverager
from swarm.train.fragments import partition, sync_steps
from swarm.train.inner import lr_lambda
from swarm.train.model import build_model
from swarm.train.trainer import Trainer
from tests.conftest import DiscardsOnce, resumed_after, tiny_config

# The tiny test model's 11 parameter tensors: embeddings (tied head) 8192 elements, q/k/v/o 1024 each, gate/up/down
# 2048 each, three norms 32 each; 18528 in all. Two fragments: the cut nearest 9264 falls after q_proj (9216).
TINY_TWO = [[0, 1], list(range(2, 11))]


def test_partition_is_contiguous_balanced_and_named_in_errors():
    numels = [8192, 1024, 1024, 1024, 1024, 2048, 2048, 2048, 32, 32, 32]
    assert partition(numels, 1) == [list(range(11))]
    assert partition(numels, 2) == TINY_TWO
    assert partition([4, 4, 4, 4], 4) == [[0], [1], [2], [3]]
    assert partition([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]  # a huge first tensor: one tensor per later part
    assert partition([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]
    with pytest.raises(ConfigError, match=r"diloco\.fragments 5 must be in \[1, 4\]"):
        partition([1, 1, 1, 1], 5)
    assert sync_steps(4, 2) == [2, 4] and sync_steps(10, 3) == [3, 6, 10] and sync_steps(7, 1) == [7]


def reference_streaming(cfg, replicas: int, groups: list[list[int]], discard=frozenset()) -> list[torch.Tensor]:
    """Streaming DiLoCo written out by hand: M AdamW replicas; fragment f's exchange starts after inner step
    (f+1)H/F of each round, its mean pseudo-gradient lands `delay` inner steps later with a Nesterov outer step on
    its tensors by formula; each replica resumed from its own outer step (F = 1) or went on from its snapshot
    (F > 1) and moves by (1 - alpha) (new global - that point). With delay 0: local <- alpha local + (1 - alpha) new
    global. Exchanges whose index round * F + f is in `discard` are dropped (once each): the replica goes back to its
    own progress."""
    corpus = load_corpus(cfg.data)
    models = [build_model(cfg.model, corpus.tokenizer.vocab_size) for _ in range(replicas)]
    params = [list(m.parameters()) for m in models]
    inner, outer, d = cfg.inner, cfg.outer, cfg.diloco
    opts = [torch.optim.AdamW(m.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=inner.eps,
                              weight_decay=inner.weight_decay) for m in models]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(inner, d.rounds * d.inner_steps)) for o in opts]
    data = [TrainBatches(corpus, cfg.data, shard=i, identity=f"replica-{i}") for i in range(replicas)]
    global_params = [p.detach().clone().float() for p in params[0]]
    momentum = [torch.zeros_like(g) for g in global_params]
    keep, F, discard = 1 - d.mix_alpha, len(groups), set(discard)

    def outer_step(ids: list[int], deltas: list[torch.Tensor]) -> None:
        for i, delta in zip(ids, deltas):
            momentum[i] = outer.momentum * momentum[i] + delta
            global_params[i] -= outer.lr * (delta + outer.momentum * momentum[i])

    def own_step(i: int, s: torch.Tensor) -> torch.Tensor:
        """Where a replica resumes from: its own outer step with one fragment, its snapshot with several."""
        if F > 1:
            return s
        delta = global_params[i] - s
        return global_params[i] - outer.lr * (delta + outer.momentum * (outer.momentum * momentum[i] + delta))

    @torch.no_grad()
    def land(ids, snapshots, deltas, dropped) -> None:
        for ps, snap in zip(params, snapshots):
            for i, s in zip(ids, snap):
                ps[i] += (s - own_step(i, s)) if dropped else -keep * own_step(i, s)
        if dropped:
            return
        outer_step(ids, deltas)
        for ps in params:
            for i in ids:
                ps[i] += keep * global_params[i]

    step, pending, committed_rounds = 0, None, 0
    while committed_rounds < d.rounds:
        for k in range(1, d.inner_steps + 1):
            for model, opt, sched, batches in zip(models, opts, scheds, data):
                x = batches.batch(step)
                model(input_ids=x, labels=x).loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
                opt.step(), sched.step(), opt.zero_grad()
            step += 1
            if pending is not None and step == pending[-1]:
                land(*pending[:-1])
                pending = None
            for f, ids in enumerate(groups):
                if k != (f + 1) * d.inner_steps // F:
                    continue
                snapshots = [[ps[i].detach().clone() for i in ids] for ps in params]
                deltas = [sum(global_params[i] - s[j] for s in snapshots) / replicas for j, i in enumerate(ids)]
                dropped = committed_rounds * F + f in discard
                discard -= {committed_rounds * F + f}  # once: a retried round reuses its exchange indices
                if f == F - 1:
                    committed_rounds += not dropped
                if d.delay:
                    with torch.no_grad():
                        for ps, snap in zip(params, snapshots):
                            for i, s in zip(ids, snap):
                                ps[i].copy_(own_step(i, s))
                    pending = (ids, snapshots, deltas, dropped, step + d.delay)
                elif not dropped:
                    outer_step(ids, deltas)
                    with torch.no_grad():
                        for ps in params:
                            for i in ids:
                                ps[i].mul_(d.mix_alpha).add_(global_params[i], alpha=keep)
    if pending is not None:
        land(*pending[:-1])
    return global_params


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fragments, delay, alpha", [(2, 1, 0.0), (2, 1, 0.5), (2, 0, 0.5), (1, 2, 0.5)])
def test_sim_fragments_equal_hand_written_reference(tmp_path, fragments, delay, alpha):
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 4, "delay": delay, "fragments": fragments,
                              "mix_alpha": alpha}, checkpoint={"every": 0})
    trainers = simulate(cfg, 3, tmp_path)
    expected = reference_streaming(cfg, 3, TINY_TWO if fragments == 2 else [list(range(11))])
    assert len({t.diloco.global_sha256() for t in trainers}) == 1, "every replica holds the same global parameters"
    assert [f.commits for f in trainers[0].fragments.all] == [3] * fragments
    for ours, ref in zip(trainers[0].diloco.global_params, expected):
        assert torch.allclose(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0, 1])
def test_fragments_one_is_todays_run(tmp_path, delay):
    """diloco.fragments 1 and mix_alpha 0 (the defaults, here explicit) are the single exchange per round."""
    runs = []
    for name, extra in [("default", {}), ("explicit", {"fragments": 1, "mix_alpha": 0.0})]:
        cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 4, "delay": delay, **extra}, checkpoint={"every": 0})
        runs.append(simulate(cfg, 2, tmp_path / name)[0])
    assert runs[0].diloco.global_sha256() == runs[1].diloco.global_sha256()
    assert [r.train_loss for r in runs[0].progress.history.rounds] == [r.train_loss for r in runs[1].progress.history.rounds]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0, 1])
def test_a_discarded_fragment_keeps_its_local_progress(tmp_path, delay):
    """Round 2's exchange of fragment 0 (after 2 outer steps) is discarded: its global tensors stay, the local model
    keeps its own progress, and the fragment's next exchange covers both rounds; the round still commits."""
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 4, "delay": delay, "fragments": 2, "mix_alpha": 0.5},
                      checkpoint={"every": 0})
    trainer = Trainer(cfg, DiscardsOnce(2), "replica-0", shard=0, out_dir=tmp_path)
    trainer.train()
    assert [f.commits for f in trainer.fragments.all] == [2, 3]
    assert [(r.round, r.committed) for r in trainer.progress.history.rounds] == [(1, True), (2, True), (3, True)]
    assert [(e["round"], e["fragment"]) for e in trainer.progress.history.events if e["event"] == "fragment_discarded"] \
        == [(1, 0)]
    expected = reference_streaming(cfg, 1, TINY_TWO, discard={2})
    for ours, ref in zip(trainer.diloco.global_params, expected):
        assert torch.allclose(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.timeout(120)
def test_a_discarded_round_end_fragment_retries_the_round(tmp_path):
    """The last fragment's exchange closes the round (after 3 outer steps): discarded, the round is trained again,
    as in blocking DiLoCo."""
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 4, "delay": 1, "fragments": 2}, checkpoint={"every": 0})
    trainer = Trainer(cfg, DiscardsOnce(3), "replica-0", shard=0, out_dir=tmp_path)
    trainer.train()
    assert trainer.diloco.round == 3 and trainer.progress.step == 16
    assert [f.commits for f in trainer.fragments.all] == [4, 3]
    assert [(r.round, r.committed) for r in trainer.progress.history.rounds] == [(1, True), (1, False), (2, True), (3, True)]
    expected = reference_streaming(cfg, 1, TINY_TWO, discard={3})
    for ours, ref in zip(trainer.diloco.global_params, expected):
        assert torch.allclose(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.timeout(60)
def test_more_fragments_than_tensors_exits_2_naming_the_key(tmp_path, cli):
    # configs/tiny.yaml: 4 layers of 9 tensors, the embeddings and the final norm: 38 tensors
    result = cli("peer", "--config", "configs/tiny.yaml", "--solo", "--out", str(tmp_path), "--diloco.fragments",
                     "39", "--diloco.delay", "0", "--data.max_documents", "60", "--logging.progress_bar", "false")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "diloco.fragments 39 must be in [1, 38]" in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0, 1])
def test_a_fragmented_run_resumes_from_its_last_committed_round(tmp_path, delay):
    """A checkpoint holds the state of a round boundary (no fragment of the next round has landed yet), so a
    resumed run restarts its local model from it, as with diloco.delay, and commits every round."""
    cfg = tiny_config(diloco={"rounds": 4, "inner_steps": 4, "delay": delay, "fragments": 2})
    straight = Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path / "straight")
    straight.train()
    second = resumed_after(cfg, tmp_path / "resumed", stop_round=2)
    assert second.diloco.round == 4 and second.progress.step == 16 + delay  # checkpointed `delay` steps into round 3
    assert [r.round for r in second.progress.history.rounds if r.committed] == [1, 2, 3, 4]
    for ours, ref in zip(second.progress.history.rounds[:2], straight.progress.history.rounds[:2]):
        assert (ours.train_loss, ours.global_sha256) == (ref.train_loss, ref.global_sha256)


@pytest.mark.timeout(60)
def test_a_fragment_that_never_stepped_shares_a_zero_momentum(tmp_path):
    """Checkpoints and served states hold the outer momentum of every tensor or none: a fragment whose only
    exchange was discarded holds zeros, which the next outer step treats exactly as no momentum."""
    cfg = tiny_config(diloco={"rounds": 1, "inner_steps": 4, "fragments": 2}, checkpoint={"every": 0})
    trainer = Trainer(cfg, DiscardsOnce(0), "a", shard=0, out_dir=tmp_path)
    trainer.train()
    assert [f.commits for f in trainer.fragments.all] == [0, 1]
    buffers = trainer.diloco.momentum_buffers()
    assert [bool(b.any()) for b in buffers] == [False] * 2 + [True] * 9


class Offers(SoloAverager):
    """Keeps a copy of every state the trainer offers: (outer steps, meta, tensors)."""

    def __init__(self):
        self.offered = []

    def offer_state(self, snapshot):
        self.offered.append((snapshot.outer_step, dict(snapshot.meta),
                             {k: t.detach().clone() for k, t in snapshot.tensors.items()}))


class BehindMidRound(Offers):
    """Finds the trainer behind at its exchange keyed `behind_at` and hands it `state` (an `Offers` entry), as a
    swarm's donor would; alone otherwise."""

    networked = True

    def __init__(self, behind_at: int, state: tuple):
        super().__init__()
        self.behind_at, self.state, self.taken = behind_at, state, False

    def average(self, round, pseudo_grad, samples, out, base=""):
        if round == self.behind_at and not self.taken:
            return ExchangeOutcome(None, behind=True, note="behind (injected)")
        return super().average(round, pseudo_grad, samples, out, base)

    def fetch_state(self, intake, round, sha256, donors=None, must=False):
        if round != self.behind_at or self.taken:
            return None
        outer_steps, meta, tensors = self.state
        for name, target in intake.destinations([TensorSpec.of(k, t) for k, t in tensors.items()]).items():
            target.copy_(tensors[name])
        intake.accept(meta, outer_steps)
        self.taken = True
        return Download(outer_steps, "donor", 0, 0.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0, 1])
def test_a_peer_behind_at_a_mid_round_exchange_goes_on_from_the_donors_inner_step(tmp_path, delay):
    """Every committed exchange is an outer step, mid-round ones too: the peer offers its state after each, with
    the inner step of the round it is at. A peer that a mid-round exchange finds behind takes that state and
    goes on from the same inner step, so its next exchanges are the donor's."""
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 4, "delay": delay, "fragments": 2}, checkpoint={"every": 0})
    donor = Trainer(cfg, Offers(), "donor", shard=0, out_dir=tmp_path / "donor")
    donor.train()
    # (outer steps, round, inner step): at the start; fragment 0 lands after inner step 2 + delay; a round's
    # closing exchange after inner step 4 (blocking) or `delay` steps into the next round, the last one at its end
    positions = [(0, 0, 0), (1, 0, 2 + delay), (2, 1, delay), (3, 1, 2 + delay), (4, 2, delay), (5, 2, 2 + delay),
                 (6, 3, 0)]
    assert [(o, m["round"], m["inner"]) for o, m, _ in donor.averager.offered] == positions
    taker = Trainer(cfg, BehindMidRound(2, donor.averager.offered[3]), "taker", shard=1, out_dir=tmp_path / "taker")
    taker.train()
    assert taker.averager.taken  # behind at round 2's fragment 0 exchange (after 2 outer steps)
    offered = taker.averager.offered
    assert [(o, m["round"], m["inner"]) for o, m, _ in offered] == positions  # the 4th: the donor's, taken
    assert offered[2][2]["global.0"].ne(donor.averager.offered[2][2]["global.0"]).any()  # its own round 1
    assert all(torch.equal(t, donor.averager.offered[3][2][k]) for k, t in offered[3][2].items())
    assert taker.progress.step == donor.progress.step == 12  # the donor's step (6 + delay) and the 2 - delay + 4 inner steps after
    assert [e["to_round"] for e in taker.progress.history.events if e["event"] == "state_downloaded"] == [1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fragments, delay, first", [(1, 0, 1), (1, 2, 1), (2, 0, 5), (2, 2, 7), (3, 1, 7)])
def test_a_round_ends_early_only_after_its_last_mid_round_exchange_landed(tmp_path, fragments, delay, first):
    """A straggler cuts its round short to meet peers that wait (round_over) only once every mid-round exchange
    of the round has landed (H = 10: fragment f starts after inner step (f + 1) * 10 // F, lands `delay` later)."""
    cfg = tiny_config(diloco={"rounds": 1, "inner_steps": 10, "delay": delay, "fragments": fragments},
                      checkpoint={"every": 0})
    frags = Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path).fragments
    assert [done for done in range(1, 10) if frags.may_stop_early(done)] == list(range(first, 10))
