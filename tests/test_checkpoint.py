"""Checkpoints: safetensors files by state_dict name and an index, checked before anything is loaded, atomic,
the last `checkpoint.keep` kept, pieces read into blocks (sharded peers)."""


import threading

import pytest
import torch
from safetensors.torch import load_file

from swarm.run.runid import run_identity
from swarm.state.checkpoint import Checkpointer, CorruptCheckpoint
from swarm.state.checkpoint_format import tensor_entry, write_index
from swarm.state.shard_checkpoint import ShardCheckpointer
from swarm.state.tensorfile import write
from swarm.train.averaging import SoloAverager
from swarm.train.trainer import Trainer
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A solo peer's folder after three committed rounds with `checkpoint.keep: 2`, and its trainer."""
    out = tmp_path_factory.mktemp("peer")
    trainer = Trainer(tiny_config(diloco={"rounds": 3, "inner_steps": 2}, checkpoint={"keep": 2}), SoloAverager(),
                      "a", shard=0, out_dir=out)
    trainer.train()
    return out / "checkpoint", trainer


def test_a_checkpoint_is_safetensors_by_state_dict_name_with_the_run_in_its_meta(run):
    folder, trainer = run
    latest = Checkpointer(folder).latest()
    assert latest == folder / "round-000003"
    stored = load_file(latest / "global.safetensors")  # any safetensors reader takes it
    params = dict(trainer.model.named_parameters())
    assert torch.equal(stored["global.model.embed_tokens.weight"], trainer.diloco.global_params[0])
    assert {f"global.{n}" for n in params} | {f"momentum.{n}" for n in params} | {"rng"} == set(stored)
    moments = load_file(latest / "inner.safetensors")
    assert set(moments) == {f"adam.{n}.{k}" for n in params for k in ("exp_avg", "exp_avg_sq", "step")}
    meta = Checkpointer(folder).read_meta()
    assert (meta["round"], meta["step"], meta["outer_steps"]) == (3, 6, 3)
    assert meta["fingerprint"] == run_identity(trainer.cfg).fingerprint and meta["config"] == trainer.cfg.to_dict()
    assert meta["data"] == {"shard": 0, "identity": "a", "epoch": 0, "offset": 24, "samples": 24, "positions": {},
                            "since": None}  # swarm/data/peerdata.py
    assert meta["hf_config"]["model_type"] == "llama"


def test_keep_n_keeps_the_newest_n_and_a_writer_s_leftovers_are_swept(run, tmp_path):
    folder, _ = run
    assert [p.name for p in Checkpointer(folder).rounds()] == ["round-000002", "round-000003"]
    assert sorted(p.name for p in folder.iterdir()) == ["round-000002", "round-000003"]  # nothing half-written
    ckpt = Checkpointer(tmp_path, keep=2)
    for round in range(1, 5):
        ckpt.save({"x": torch.full((3,), float(round))}, {"round": round})
    assert [p.name for p in ckpt.rounds()] == ["round-000003", "round-000004"]
    ckpt.begin({"x": torch.zeros(3)})  # a writer that dies before its commit leaves a partial folder ...
    ckpt.wait_begun()
    assert len(list(tmp_path.glob(".partial-*"))) == 1
    assert Checkpointer(tmp_path).load_all()[1]["round"] == 4  # ... which no reader sees
    ckpt.abort()
    assert not list(tmp_path.glob(".partial-*"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [Checkpointer, lambda folder: ShardCheckpointer(folder, 1, 0, 1, 1, lambda key: None)],
                         ids=["whole", "sharded"])
def test_the_begun_moments_are_owed_until_written_even_once_the_round_committed(tmp_path, make):
    """begin() writes the AdamW moments in the background and the trainer changes them once wait_begun() returns.
    A commit() that came first used to forget that write: wait_begun() returned at once, and the next inner steps
    changed moments still being written (a checkpoint holding parts of two steps' moments, its CRCs matching)."""
    written = threading.Event()

    class Slow(dict):  # its tensors are handed to the writer only once the test says so
        def items(self):
            written.wait(20)
            return super().items()

    ckpt = make(tmp_path)
    ckpt.begin(Slow({"adam.m": torch.ones(4)}))
    ckpt.commit({"global.w": torch.zeros(2)}, {"round": 1})
    waiter = threading.Thread(target=ckpt.wait_begun)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # the moments are still being written: they must not change yet
    written.set()
    waiter.join(20)
    ckpt.wait()
    assert not waiter.is_alive() and Checkpointer(tmp_path).load_all()[1]["round"] == 1


@pytest.mark.timeout(60)
def test_a_damaged_checkpoint_is_refused_naming_it_before_anything_is_loaded(tmp_path):
    good = tmp_path / "good"
    Checkpointer(good).save({"x": torch.ones(3), "y": torch.arange(4, dtype=torch.bfloat16)}, {"round": 1})
    folder = good / "round-000001"
    data, index = (folder / "global.safetensors").read_bytes(), (folder / "index.json").read_text()
    damages = {
        "truncated": lambda: (folder / "global.safetensors").write_bytes(data[: len(data) - 3]),
        "a flipped byte of x": lambda: (folder / "global.safetensors").write_bytes(  # y: the last 8 bytes
            data[:-9] + bytes([data[-9] ^ 1]) + data[-8:]),
        "an edited index": lambda: (folder / "index.json").write_text(index.replace('"round": 1', '"round": 7')),
        "a lost file": lambda: (folder / "global.safetensors").unlink(),
    }
    for what, damage in damages.items():
        damage()
        x = torch.zeros(3)
        with pytest.raises(CorruptCheckpoint, match=f"corrupt checkpoint {folder}"):
            Checkpointer(good).load(lambda specs, x=x: {"x": x})
        assert torch.equal(x, torch.zeros(3)), what  # untouched
        (folder / "global.safetensors").write_bytes(data)
        (folder / "index.json").write_text(index)
    tensors, meta = Checkpointer(good).load_all()
    assert meta["round"] == 1 and torch.equal(tensors["y"], torch.arange(4, dtype=torch.bfloat16))


def test_a_checkpoint_holds_its_meta_as_it_was_at_commit_while_the_caller_goes_on(tmp_path):
    """The trainer goes on changing its history while the index is written in the background (a round's
    overhead is recorded after its commit): the checkpoint holds the meta of its commit, whole and valid."""
    ckpt = Checkpointer(tmp_path)
    ckpt.begin({"moments": torch.zeros(2**22)})  # still being written when the caller moves on
    meta = {"round": 1, "history": {"rounds": [{"overhead_s": 0.0}]}}
    ckpt.commit({"x": torch.ones(3)}, meta)
    meta["history"]["rounds"][0]["overhead_s"] = 0.5
    meta["history"]["rounds"].append({"overhead_s": 1.0})
    ckpt.wait()
    assert Checkpointer(tmp_path).read_meta() == {"round": 1, "history": {"rounds": [{"overhead_s": 0.0}]}}


@pytest.mark.timeout(60)
def test_a_checkpoint_pruned_while_it_is_read_is_read_whole_and_never_mixed_with_the_newer(tmp_path):
    """The files checked are the files read: the writer landing a newer checkpoint and deleting this one
    (`keep: 1`) between the check and the read changes nothing of what the reader gets."""
    writer = Checkpointer(tmp_path)
    writer.save({"x": torch.ones(3)}, {"round": 1})
    out = torch.zeros(3)

    def destinations(specs):
        writer.save({"x": torch.full((3,), 2.0)}, {"round": 2})
        assert not (tmp_path / "round-000001").exists()
        return {"x": out}
    assert Checkpointer(tmp_path).load(destinations)["round"] == 1 and torch.equal(out, torch.ones(3))
    tensors, meta = Checkpointer(tmp_path).load_all()
    assert meta["round"] == 2 and torch.equal(tensors["x"], torch.full((3,), 2.0))


def test_a_tensor_stored_in_pieces_reads_whole_or_into_the_blocks_of_another_split(tmp_path):
    """What a sharded peer writes (one file per rank, a block of each tensor in each) reads into a whole tensor,
    or into blocks split another way (a joiner with another number of ranks)."""
    full = torch.arange(24, dtype=torch.float32).view(6, 4)
    folder = tmp_path / "round-000001"
    folder.mkdir()
    pieces = []
    for rank, rows in enumerate([(0, 4), (4, 6)]):  # two ranks, 4 and 2 rows
        name = f"global-{rank + 1:05d}-of-00002.safetensors"
        with open(folder / name, "wb") as f:
            crc = write(f, {"global.w": full[rows[0]:rows[1]]}, {})["global.w"]
        pieces.append({"file": name, "offset": [rows[0], 0], "shape": [rows[1] - rows[0], 4], "crc32": crc})
    write_index(folder, {"round": 1}, {"global.w": {**tensor_entry(full, "", 0), "pieces": pieces}})
    tensors, _ = Checkpointer(tmp_path).load_all()
    assert torch.equal(tensors["global.w"], full)
    blocks = [torch.zeros(3, 4), torch.zeros(3, 4)]  # three ranks' worth of rows... two of them
    Checkpointer(tmp_path).load(lambda specs: {"global.w": (blocks[1], (3, 0))})
    Checkpointer(tmp_path).load(lambda specs: {"global.w": (blocks[0], (0, 0))})
    assert torch.equal(torch.cat(blocks), full)
