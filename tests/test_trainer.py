"""The two-level loop: sim equals a hand-written reference, solo learns, resume is exact."""

import copy
import csv
import json

import pytest
import torch

from peers.local_trainers import simulate
from swarm.data.batches import TrainBatches, load_corpus
from swarm.errors import SwarmError
from swarm.run.report import METRICS_COLUMNS
from swarm.state.checkpoint import CorruptCheckpoint
from swarm.state.checkpoint_format import INDEX
from swarm.state.peerstate import TensorSpec
from swarm.train.averaging import Download, SoloAverager
from swarm.train.inner import evaluate, lr_lambda
from swarm.train.model import build_model
from swarm.train.trainer import NON_FINITE_TRIES, Trainer
from tests.conftest import DiscardsOnce, Interrupt, resumed_after, tiny_config


def reference_diloco(cfg, replicas: int) -> list[torch.Tensor]:
    """DiLoCo written out by hand: M AdamW replicas, mean pseudo-gradient, Nesterov update by formula."""
    corpus = load_corpus(cfg.data)
    models = [build_model(cfg.model, corpus.tokenizer.vocab_size) for _ in range(replicas)]
    inner = cfg.inner
    opts = [torch.optim.AdamW(m.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=inner.eps,
                              weight_decay=inner.weight_decay) for m in models]
    total = cfg.diloco.rounds * cfg.diloco.inner_steps
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(inner, total)) for o in opts]
    data = [TrainBatches(corpus, cfg.data, shard=i, identity=f"replica-{i}") for i in range(replicas)]
    global_params = [p.detach().clone().float() for p in models[0].parameters()]
    momentum = [torch.zeros_like(g) for g in global_params]
    delay, pending = cfg.diloco.delay, None  # pending: each replica's snapshot and the mean pseudo-gradient

    def outer_step(deltas: list[torch.Tensor]) -> None:
        for i, (g, delta) in enumerate(zip(global_params, deltas)):
            momentum[i] = cfg.outer.momentum * momentum[i] + delta
            g -= cfg.outer.lr * (delta + cfg.outer.momentum * momentum[i])

    def own_step(i: int, s: torch.Tensor) -> torch.Tensor:
        """Global tensor i after an outer step on one replica's own pseudo-gradient (where it resumes from)."""
        d = global_params[i] - s
        return global_params[i] - cfg.outer.lr * (d + cfg.outer.momentum * (cfg.outer.momentum * momentum[i] + d))

    @torch.no_grad()
    def resume_from_own_step(snapshots: list[list[torch.Tensor]]) -> None:
        for m, snapshot in zip(models, snapshots):
            for i, (p, s) in enumerate(zip(m.parameters(), snapshot)):
                p.copy_(own_step(i, s))

    @torch.no_grad()
    def land(snapshots: list[list[torch.Tensor]], deltas: list[torch.Tensor]) -> None:
        """The delayed outer step; each replica moves by new global - where it resumed from."""
        for m, snapshot in zip(models, snapshots):
            for i, (p, s) in enumerate(zip(m.parameters(), snapshot)):
                p -= own_step(i, s)
        outer_step(deltas)
        for m in models:
            for p, g in zip(m.parameters(), global_params):
                p += g

    step = 0
    for _ in range(cfg.diloco.rounds):
        for k in range(cfg.diloco.inner_steps):
            for model, opt, sched, batches in zip(models, opts, scheds, data):
                x = batches.batch(step)
                model(input_ids=x, labels=x).loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
                opt.step(), sched.step(), opt.zero_grad()
            step += 1
            if pending is not None and k + 1 == delay:
                land(*pending)
                pending = None
        snapshots = [[p.detach().clone() for p in m.parameters()] for m in models]
        deltas = [sum(g - s[i] for s in snapshots) / replicas for i, g in enumerate(global_params)]
        if delay:
            pending = (snapshots, deltas)
            resume_from_own_step(snapshots)
            continue
        outer_step(deltas)
        with torch.no_grad():
            for m in models:
                for p, g in zip(m.parameters(), global_params):
                    p.copy_(g)
    if pending is not None:
        land(*pending)
    return global_params


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0, 2])
def test_sim_equals_hand_written_reference(tmp_path, delay):
    """Blocking rounds, and rounds whose outer step lands 2 inner steps into the next round (diloco.delay)."""
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 3, "delay": delay}, checkpoint={"every": 0})
    trainers = simulate(cfg, 3, tmp_path)
    expected = reference_diloco(cfg, 3)
    hashes = {t.diloco.global_sha256() for t in trainers}
    assert len(hashes) == 1, "every replica must hold the same global parameters"
    for ours, ref in zip(trainers[0].diloco.global_params, expected):
        assert torch.allclose(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.timeout(180)
def test_solo_cli_lowers_eval_loss_and_writes_summary(tmp_path, swarm_cmd):
    result = swarm_cmd("peer", "--config", "configs/tiny.yaml", "--solo", "--out", str(tmp_path),
                       "--diloco.rounds", "2", "--diloco.inner_steps", "15", "--data.max_documents", "200",
                       "--model.num_layers", "2", "--logging.progress_bar", "false", timeout=170)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (peer,) = summary["peers"]
    assert peer["rounds_completed"] == 2 and len(peer["round_hashes"]) == 2
    assert peer["eval_loss"][-1] < peer["initial_eval_loss"] - 1.0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert "eval loss" in result.stderr
    log = (tmp_path / "log.txt").read_text()  # the same lines as stderr, in the run folder
    assert "round 2 committed" in log and "round 2 committed" in result.stderr


@pytest.mark.timeout(120)
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    cfg = tiny_config(diloco={"rounds": 4, "inner_steps": 3})
    straight = Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path / "straight")
    straight.train()
    second = resumed_after(cfg, tmp_path / "resumed", stop_round=2)

    ours = [(r.train_loss, r.eval_loss) for r in second.progress.history.rounds]
    ref = [(r.train_loss, r.eval_loss) for r in straight.progress.history.rounds]
    assert len(ours) == len(ref) == 4
    for (a, b), (c, d) in zip(ours, ref):
        assert abs(a - c) < 1e-6 and abs(b - d) < 1e-6
    assert second.diloco.global_sha256() == straight.diloco.global_sha256()


def stop_at(round: int):
    def stop(record) -> None:
        if record.round == round:
            raise Interrupt
    return stop


def test_every_closed_round_appends_a_row_of_metrics_csv_and_a_resumed_peer_goes_on_appending(tmp_path):
    """And, with logging.tensorboard, the same rounds as TensorBoard scalars, read back from the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 2}, logging={"tensorboard": True})
    with pytest.raises(Interrupt):
        Trainer(cfg, DiscardsOnce(1), "a", shard=0, out_dir=tmp_path, on_round=stop_at(2)).train()
    Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path).train()
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == METRICS_COLUMNS
    # round 2's first exchange was discarded, the second committed; the peer stopped there and, resumed from its
    # checkpoint, trained round 3
    assert [(r["round"], r["committed"], r["inner_step"]) for r in rows] == [
        ("1", "True", "2"), ("1", "False", "4"), ("2", "True", "6"), ("3", "True", "8")]
    assert all(float(r["train_loss"]) > 0 and len(r["global_sha256"]) == 64 for r in rows)
    assert rows[-1]["eval_loss"] and rows[1]["eval_loss"] == ""
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    train = events.Scalars("loss/train")
    assert [e.step for e in train] == [2, 4, 6, 8]
    assert [round(e.value, 4) for e in train] == [round(float(r["train_loss"]), 4) for r in rows]
    assert [e.value for e in events.Scalars("swarm/committed")] == [1.0, 0.0, 1.0, 1.0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0, 2])
def test_a_discarded_last_round_is_trained_again_and_committed(tmp_path, delay):
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 3, "delay": delay}, checkpoint={"every": 0})
    trainer = Trainer(cfg, DiscardsOnce(2), "a", shard=0, out_dir=tmp_path)
    trainer.train()
    assert trainer.diloco.round == 3
    assert [(r.round, r.committed) for r in trainer.progress.history.rounds] == [(1, True), (2, True), (2, False), (3, True)]
    assert trainer.progress.step == 12  # the discarded round's inner steps, and one more round of them


@pytest.mark.timeout(120)
def test_a_delayed_run_resumes_from_its_last_committed_round(tmp_path):
    """diloco.delay: a checkpoint holds the committed state, not the local model running ahead of it (nor the
    exchange in flight), so a resumed run re-trains from the last committed round; it still commits every round."""
    cfg = tiny_config(diloco={"rounds": 4, "inner_steps": 3, "delay": 2})
    straight = Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path / "straight")
    straight.train()
    second = resumed_after(cfg, tmp_path / "resumed", stop_round=2)
    assert second.diloco.round == 4
    assert [r.round for r in second.progress.history.rounds if r.committed] == [1, 2, 3, 4]
    for ours, ref in zip(second.progress.history.rounds[:2], straight.progress.history.rounds[:2]):
        assert (ours.train_loss, ours.global_sha256) == (ref.train_loss, ref.global_sha256)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay, fragments", [(2, 1), (0, 2)])
def test_a_round_s_eval_loss_is_that_of_the_committed_global_parameters(tmp_path, delay, fragments):
    """With overlap the local model has run ahead of the global parameters when a round closes (the inner steps
    behind a delayed exchange, or those since another fragment landed); the round's eval is still of the global
    parameters, what the swarm committed."""
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 4, "delay": delay, "fragments": fragments},
                      checkpoint={"every": 0})
    trainer = Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path)
    seen = []

    def on_round(record):
        probe = copy.deepcopy(trainer.model)
        with torch.no_grad():
            for p, g in zip(probe.parameters(), trainer.diloco.global_params):
                p.copy_(g)
        ahead = any(not torch.equal(p, g) for p, g in zip(trainer.diloco.params, trainer.diloco.global_params))
        seen.append((record.eval_loss, evaluate(probe, trainer.eval_batches, trainer.device, trainer.precision), ahead))

    trainer.on_round = on_round
    trainer.train()
    assert len(seen) == 3 and any(ahead for *_, ahead in seen)  # the local model was ahead at a round's close
    for reported, of_global, _ in seen:
        assert reported == pytest.approx(of_global, abs=1e-6)


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_written(tmp_path):
    cfg = tiny_config(diloco={"rounds": 1, "inner_steps": 2})
    big = Trainer(tiny_config(model={"hidden_size": 48}, diloco={"rounds": 1, "inner_steps": 2}), SoloAverager(),
                  "a", shard=0, out_dir=tmp_path)
    big.state.save_checkpoint()
    small = Trainer(cfg, SoloAverager(), "b", shard=0, out_dir=tmp_path)
    before = small.diloco.global_sha256()
    with pytest.raises(CorruptCheckpoint, match="does not fit this model: tensor 0 is global.0"):
        small.state.resume()
    assert small.diloco.global_sha256() == before


@pytest.mark.timeout(120)
def test_cli_corrupt_checkpoint_exits_1_naming_it(tmp_path, cli):
    damaged = tmp_path / "checkpoint" / "round-000001"
    damaged.mkdir(parents=True)
    (damaged / INDEX).write_bytes(b"{not an index" + b"\0" * 64)
    result = cli("peer", "--config", "configs/tiny.yaml", "--solo", "--out", str(tmp_path),
                     "--data.max_documents", "60")
    assert result.returncode == 1
    assert "corrupt checkpoint" in result.stderr and "round-000001" in result.stderr
    last = (tmp_path / "log.txt").read_text().strip().splitlines()[-1]  # the log alone says how it ended
    assert "swarm: error:" in last and "corrupt checkpoint" in last and "Traceback" not in result.stderr
    assert (damaged / INDEX).read_bytes() == b"{not an index" + b"\0" * 64  # left as it was


class PoisonedDonor(SoloAverager):
    """A swarm whose only state to take is poisoned: its global parameters are NaN."""

    networked = True

    def fetch_state(self, intake, outer_step, sha256, donors=None, must=False):
        if not must:
            return None
        for name, target in intake.destinations(self.specs).items():
            target.copy_(self.tensors[name])
        intake.accept(dict(self.meta), outer_step)
        return Download(outer_step, "poisoner", 0, 0.0)


def test_a_model_that_goes_non_finite_after_every_state_taken_stops_naming_the_round_and_donor(tmp_path):
    """The swarm serves a state that turns the local model NaN at once: the peer takes it a bounded number of times
    (`NON_FINITE_TRIES`), then stops with a SwarmError naming the round and the donor, instead of looping."""
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 2}, faults={"nan_round": 1}, checkpoint={"every": 0})
    poisoned = PoisonedDonor()
    trainer = Trainer(cfg, poisoned, "a", shard=0, out_dir=tmp_path)
    poisoned.tensors = {k: torch.full_like(t, float("nan")) if k.startswith("global.") else t.clone()
                        for k, t in trainer.state.snapshot().tensors.items()}
    poisoned.specs = [TensorSpec.of(k, t) for k, t in poisoned.tensors.items()]
    poisoned.meta = {"round": 0, "step": 0, "inner": 0}
    with pytest.raises(SwarmError, match=rf"round 1: the local model went non-finite {NON_FINITE_TRIES + 1} times "
                                         r"in a row, the last after taking the state of poisoner"):
        trainer.train()
    events = [e["event"] for e in trainer.progress.history.events]
    assert events.count("non_finite_model") == NON_FINITE_TRIES + 1
    assert events.count("state_downloaded") == NON_FINITE_TRIES
    assert not trainer.progress.history.rounds


@pytest.mark.timeout(120)
def test_wandb_offline_keeps_every_round_and_a_resumed_peer_goes_on_in_the_same_run(tmp_path):
    """The sinks alone (swarm/run/metrics.py), without training: two starts of one peer folder, a round each."""
    from swarm.run.metrics import Metrics
    from swarm.train.history import RoundRecord

    cfg = tiny_config(logging={"wandb": "swarm-test", "wandb_mode": "offline"})
    ids = []
    for round, step in [(1, 4), (2, 8)]:  # started, stopped after round 1, started again
        metrics = Metrics(cfg, tmp_path, "a")
        metrics.round(RoundRecord(round=round, committed=True, train_loss=2.5, eval_loss=None, global_sha256="f" * 64,
                                  group_size=2, samples=8, compute_s=1.0, comm_s=0.5, bytes_sent=10,
                                  bytes_received=10, tokens_per_s=100.0, time=1000.0 + round), step)
        metrics.close()
        ids.append((tmp_path / "wandb-id.txt").read_text().strip())
    assert ids[0] == ids[1]
    logs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{ids[0]}/run-{ids[0]}.wandb"))
    assert logs  # one file per start (two starts in one second share a folder), one W&B run: `wandb sync` merges them
    assert all(b"loss/train" in log.read_bytes() and b"inner_step" in log.read_bytes() for log in logs)
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 3  # the header and a row per round


@pytest.mark.timeout(60)
def test_a_taken_state_sets_only_what_its_hash_covers(tmp_path):
    """A donor serves its global parameters and outer momentum, never its AdamW moments; a taker refuses a state
    that carries them (no hash vouches for a donor's own moments), starts its inner optimizer afresh, and puts
    itself on the schedule at the committed round whatever step the donor claims (swarm/state/statehash.py)."""
    from swarm.state.peerstate import shared_tensors

    cfg = tiny_config(diloco={"rounds": 2, "inner_steps": 4}, checkpoint={"every": 0})
    donor = Trainer(cfg, SoloAverager(), "donor", shard=0, out_dir=tmp_path / "donor")
    donor.train()
    served = donor.state.snapshot()
    assert {k.partition(".")[0] for k in served.tensors} == {"global", "momentum"}
    taker = Trainer(cfg, SoloAverager(), "taker", shard=1, out_dir=tmp_path / "taker")
    intake = taker.state.intake()
    with_moments = shared_tensors(donor.diloco, donor.optimizer)
    with pytest.raises(ValueError, match=r"carries adam\.0\.exp_avg, which the state's hash does not cover"):
        intake.destinations([TensorSpec.of(k, t) for k, t in with_moments.items()])
    taker.model(torch.zeros(1, 8, dtype=torch.long)).logits.sum().backward()
    taker.optimizer.step()  # moments of its own, which a taken state drops
    targets = intake.destinations([TensorSpec.of(k, t) for k, t in served.tensors.items()])
    for name, target in targets.items():
        target.copy_(served.tensors[name])
    with pytest.raises(ValueError, match="not a position of this run"):
        intake.accept(dict(served.meta, inner=1), served.outer_step)  # one fragment: a taker starts the round
    intake.accept(dict(served.meta, step=10**6), served.outer_step)
    assert (taker.diloco.round, taker.progress.step) == (2, 2 * 4) and not taker.optimizer.state
    assert taker.diloco.global_sha256() == donor.diloco.global_sha256() == served.sha256
