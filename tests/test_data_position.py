"""A peer's data position (swarm/data/peerdata.py): its own batch order, recorded by its checkpoint and continued exactly
on resume, across shards it held; an older checkpoint's (shard, epoch, step) is read too."""

import json

import pytest
import torch

from swarm.data.batches import TrainBatches, load_corpus
from swarm.data.peerdata import PeerData
from swarm.run.report import data_overlap, write_summary
from swarm.state.checkpoint import Checkpointer
from swarm.train.averaging import SoloAverager
from swarm.train.ranks import SINGLE
from swarm.train.trainer import Trainer
from tests.conftest import Interrupt, tiny_config


def stop_at(round: int):
    def stop(record) -> None:
        if record.round == round:
            raise Interrupt
    return stop


def recording(trainer: Trainer, read: list[int]) -> Trainer:
    """`trainer`, its data noting the windows of every batch it reads into `read`."""
    data, next_batch = trainer.data, trainer.data.next_batch

    def noted():
        b = data.current()
        read.extend(b.ids_at(b.position, b.cfg.batch_size))
        return next_batch()

    data.next_batch = noted
    return trainer


@pytest.mark.timeout(120)
def test_an_interrupted_and_resumed_peer_reads_the_windows_the_uninterrupted_one_did(tmp_path):
    """Resumed under another name and another fixed shard (a hostname-pid name changes across restarts), the peer
    reads on from its checkpoint's shard, order identity and position: the same windows, the same model."""
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 3})
    uninterrupted, interrupted = [], []
    straight = recording(Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path / "straight"), uninterrupted)
    straight.train()
    with pytest.raises(Interrupt):
        recording(Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path / "resumed", on_round=stop_at(1)),
                  interrupted).train()
    assert interrupted == uninterrupted[:12]
    meta = Checkpointer(tmp_path / "resumed" / "checkpoint").read_meta()
    assert meta["data"] == {"shard": 0, "identity": "a", "epoch": 0, "offset": 12, "samples": 12, "positions": {},
                            "since": None}
    after = []
    resumed = recording(Trainer(cfg, SoloAverager(), "c", shard=5, out_dir=tmp_path / "resumed"), after)
    resumed.train()
    assert interrupted + after == uninterrupted and len(set(uninterrupted)) == 36
    assert resumed.batches.state() == straight.batches.state() == {
        "shard": 0, "identity": "a", "epoch": 36 // len(straight.batches), "offset": 36 % len(straight.batches),
        "samples": 36}
    assert resumed.diloco.global_sha256() == straight.diloco.global_sha256()
    assert resumed.progress.history.data == {"shard": 0, "identity": "a", "leased": False, "samples": 36,
                                    "overlap_samples": 0}


def test_two_peers_on_one_shard_never_draw_the_same_batches():
    cfg = tiny_config(data={"num_shards": 2}).data
    corpus = load_corpus(cfg)
    a, b = TrainBatches(corpus, cfg, 1, "peer-a"), TrainBatches(corpus, cfg, 1, "peer-b")
    n = len(a)
    assert sorted(a.ids_at(0, n)) == sorted(b.ids_at(0, n))  # one shard: the same windows each epoch ...
    steps = n // cfg.batch_size
    assert all(not torch.equal(a.batch(s), b.batch(s)) for s in range(steps))  # ... in another order
    assert a.ids_at(0, 3 * n) == TrainBatches(corpus, cfg, 1, "peer-a").ids_at(0, 3 * n)  # stable per identity


class MovingLeases:
    """A lease that gives shard `first` at start and `then` from the second round on; records what it is asked."""

    def __init__(self, first: int, then: int):
        self.first, self.then, self.since, self.overlap_samples = first, then, 123.0, 0
        self.asked: list[tuple] = []

    def acquire(self, preferred, since, positions):
        self.asked.append(("acquire", preferred, since, dict(positions)))
        return self.first if preferred is None else preferred

    def renew(self, positions):
        self.asked.append(("renew", dict(positions)))
        self.overlap_samples += 4
        return self.then


@pytest.mark.timeout(120)
def test_a_leased_peer_moved_between_shards_resumes_on_its_shard_with_every_position_kept(tmp_path):
    cfg = tiny_config(diloco={"rounds": 3, "inner_steps": 3})
    leases = MovingLeases(first=1, then=2)
    with pytest.raises(Interrupt):
        Trainer(cfg, SoloAverager(), "a", shard=None, out_dir=tmp_path, leases=leases, on_round=stop_at(2)).train()
    assert leases.asked == [("acquire", None, None, {}), ("renew", {1: 12})]
    data = Checkpointer(tmp_path / "checkpoint").read_meta()["data"]
    assert data == {"shard": 2, "identity": "a", "epoch": 0, "offset": 12, "samples": 12, "positions": {"1": 12},
                    "since": 123.0}
    again = MovingLeases(first=0, then=2)
    resumed = Trainer(cfg, SoloAverager(), "a", shard=None, out_dir=tmp_path, leases=again)
    resumed.train()
    assert again.asked[0] == ("acquire", 2, 123.0, {1: 12, 2: 12})  # its shard back, since its first claim
    assert resumed.batches.state()["samples"] == 24 and resumed.data.positions == {1: 12}
    assert resumed.progress.history.data["samples"] == 36 and resumed.progress.history.data["leased"]


def test_an_older_checkpoint_s_position_is_step_times_batch_in_the_order_of_seed_and_shard():
    cfg = tiny_config(data={"num_shards": 4}).data
    data = PeerData(load_corpus(cfg), cfg, "a", 0, "run", SINGLE)
    data.restore({"shard": 3, "epoch": 0, "step": 5}, 5)
    data.take()
    assert data.batches.shard == 3 and data.batches.position == 5 * cfg.batch_size and data.identity == ""
    assert torch.equal(data.next_batch(), TrainBatches(load_corpus(cfg), cfg, 3).batch(5))


def test_data_overlap_is_the_share_of_samples_trained_on_a_shared_shard(tmp_path):
    peers = [{"data": {"samples": 100, "overlap_samples": 25}}, {"data": {"samples": 300, "overlap_samples": 0}},
             {"data": {}}]  # a peer that never trained
    assert data_overlap(p["data"] for p in peers) == 25 / 400 and data_overlap([]) == 0.0
    summary = json.loads(write_summary(tmp_path, "run", "local", {}, 1.0, [
        {**p, "peer_id": str(i), "rounds": [], "train_loss": [], "eval_loss": []} for i, p in enumerate(peers)]
    ).read_text())
    assert summary["data_overlap"] == 25 / 400
