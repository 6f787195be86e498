"""Sharded peers (swarm/train/sharding.py, `inner.parallel: fsdp`): the row layout of shards, the models that cannot be
sharded and the configs that are refused, peers of two and of four FSDP ranks training as one process does (in bf16,
with activation checkpointing and micro-batches), their memory per rank, and swarms of sharded peers."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from peers.local_swarm import parse_ranks
from swarm.config import ConfigError, shared_config
from swarm.data.batches import build_tokenizer
from swarm.errors import UsageError
from swarm.run.configfile import load_config
from swarm.state import shard_state
from swarm.state.export import export_hf
from swarm.state.peerstate import TensorSpec
from swarm.train import accounting
from swarm.train.averaging import SoloAverager
from swarm.train.diloco import DiLoCo
from swarm.train.model import build_model, count_parameters
from swarm.train.sharding import Layout, find_blocks, shards_model
from swarm.train.trainer import Trainer
from tests.conftest import ROOT, tiny_config
from tests.swarm_harness import SMALL

SECTIONS = dict(model={"num_layers": 2}, diloco={"rounds": 2, "inner_steps": 3}, checkpoint={"every": 0},
                data={"shard": 0})


def overrides(sections: dict) -> list[str]:
    """`sections` (and tiny_config's own) as the command line's --section.key VALUE."""
    cfg = tiny_config(**sections)
    args = []
    for section, keys in [("model", ["hidden_size", "num_layers", "num_heads", "intermediate_size", "max_seq_len"]),
                          ("data", ["seq_len", "batch_size", "eval_batches", "max_documents", "shard"]),
                          ("inner", ["warmup_steps", "precision", "activation_checkpointing", "micro_batch_size"]),
                          ("diloco", ["rounds", "inner_steps", "delay", "fragments", "threads"]), ("checkpoint", ["every"])]:
        for key in keys:
            value = getattr(getattr(cfg, section), key)
            if value is not None:
                args += [f"--{section}.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return [*args, "--logging.progress_bar", "false"]


def test_each_rank_holds_the_rows_torch_chunk_gives_it():
    layout = Layout((torch.Size([5, 3]), torch.Size([1]), torch.Size([8])), world_size=4)
    for i, shape in enumerate(layout.shapes):
        chunks = torch.arange(layout.numels[i]).view(shape).chunk(4)
        for rank in range(4):
            start, end = layout.span(i, rank)
            got = chunks[rank].reshape(-1).tolist() if rank < len(chunks) else []
            assert list(range(start, end)) == got
    assert [layout.rows(0, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert layout.padded(0) == 6 and Layout(layout.shapes, 4, 3).local_shape(0) == torch.Size([0, 3])


def test_models_without_blocks_to_shard_and_bad_configs_are_refused():
    with pytest.raises(UsageError, match="Sequential has no list of transformer blocks"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.head = torch.nn.Linear(2, 2)
            self.head.weight = self.layers[0].weight

    with pytest.raises(UsageError, match="parameter head.weight is tied to a transformer block's"):
        find_blocks(Tied())
    # one rank: nothing to shard over, the same as no sharding
    assert not shards_model("fsdp", 1) and not shards_model("ddp", 4) and shards_model("fsdp", 2)
    with pytest.raises(ConfigError, match="inner.optimizer adamw8bit cannot step the sharded parameters"):
        tiny_config(inner={"parallel": "fsdp", "optimizer": "adamw8bit"})
    with pytest.raises(ConfigError, match="inner.parallel: 'zero3' is not one of"):
        tiny_config(inner={"parallel": "zero3"})
    # a peer's own business: sharded and unsharded peers are peers of one run
    assert shared_config(tiny_config(inner={"parallel": "fsdp"})) == shared_config(tiny_config())


def trains_like_one_process(tmp_path, swarm_cmd, sections: dict, ranks: int):
    """A `swarm peer --solo` of `ranks` FSDP ranks with `sections` against one process in this one with the same
    config (named as a --solo peer is: the batch order is seeded by the peer's name, swarm/data/batches.py): the
    same train and eval losses up to float rounding, and every rank on the peer's final hash. The peer's folder."""
    one = Trainer(tiny_config(**sections), SoloAverager(), "solo", shard=0, out_dir=tmp_path / "one").train()
    out = tmp_path / f"ranks-{ranks}"
    result = swarm_cmd("peer", "--config", "configs/tiny.yaml", "--solo", "--nproc-per-node", str(ranks), "--out",
                       str(out), "--inner.parallel", "fsdp", *overrides(sections), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    (peer,) = json.loads((out / "summary.json").read_text())["peers"]
    assert peer["nproc"] == ranks
    assert peer["train_loss"] == pytest.approx([r.train_loss for r in one.rounds], abs=1e-5)
    assert peer["eval_loss"] == pytest.approx([r.eval_loss for r in one.rounds], abs=1e-5)
    hashes = [json.loads(p.read_text())["global_sha256"] for p in sorted((out / "ranks").glob("rank-*.json"))]
    assert hashes == [peer["final_global_sha256"]] * ranks
    return out


def test_two_fsdp_ranks_train_like_one_process(tmp_path, swarm_cmd):
    """K = 2 sharded ranks against one process in this one (K = 4: the next test), delayed exchanges of two
    fragments through the node-local files (rows in, the average out), outer steps on the shards, the local model
    moved under FSDP between inner steps and evals; the files' names are gone with the peer. Networked rounds: the
    local swarms' tests below."""
    sections = {**SECTIONS, "diloco": {"rounds": 2, "inner_steps": 4, "delay": 1, "fragments": 2}}
    out = trains_like_one_process(tmp_path, swarm_cmd, sections, 2)
    assert not list((out / "shards").glob("exchange-*"))


@pytest.mark.timeout(180)
def test_four_fsdp_ranks_in_bf16_with_checkpointing_and_micro_batches_train_like_one_process(tmp_path, swarm_cmd):
    """K = 4 sharded ranks, bf16 autocast, activation checkpointing and one micro-batch of 2 per rank, against one
    process with the same precision, checkpointing and micro-batches (8 sequences in 4 passes of 2): the same
    sequences meet the same weights in every pass, so the runs differ only by the order in which the four passes'
    gradients are summed (a reduce-scatter against accumulation): the losses agree to 1e-6 (measured), where bf16
    against fp32 autocast alone moves them by 4e-5 and 1.3e-4. Delayed exchanges, as the shipped configs run them."""
    sections = {**SECTIONS, "diloco": {"rounds": 2, "inner_steps": 3, "delay": 1},
                "data": {"shard": 0, "batch_size": 8},
                "inner": {"precision": "bf16", "activation_checkpointing": True, "micro_batch_size": 2}}
    trains_like_one_process(tmp_path, swarm_cmd, sections, 4)


# A model whose training state (24 bytes per parameter) is some hundreds of MiB: far above what a rank's peak
# memory varies by, small enough to train a round in seconds on 2 cores; and one of ~30k parameters, the same
# peer otherwise, whose ranks' peak is the per-process constant (interpreter, torch, gloo, the corpus).
STATE_MODEL = ["--model.hidden_size", "512", "--model.num_layers", "6", "--model.num_heads", "8",
               "--model.intermediate_size", "1376"]
EMPTY_MODEL = ["--model.hidden_size", "32", "--model.num_layers", "2", "--model.num_heads", "2",
               "--model.intermediate_size", "64"]


@pytest.mark.timeout(240)
def test_no_rank_of_a_sharded_peer_holds_the_whole_training_state(tmp_path, swarm_cmd):
    """A peer of two FSDP ranks allowed, each, three quarters of the model's full training state (parameters,
    gradients, AdamW moments, global parameters, outer momentum: 24 bytes per parameter) over the per-process
    constant, while its share is a half: it starts, trains a round and commits, and no rank's peak resident memory
    ever went past that allowance. A rank that built the model whole and then sharded it, gathered the
    pseudo-gradient or its average, or held the whole global parameters and momentum would have (bench/shards.py
    measures the same per K, 1.15x to 1.30x of the share)."""
    run = ["--config", "configs/tiny.yaml", "--solo", "--nproc-per-node", "2", "--inner.parallel", "fsdp",
           "--diloco.rounds", "1", "--diloco.inner_steps", "2", "--inner.warmup_steps", "1", "--diloco.threads", "1",
           "--data.seq_len", "32", "--model.max_seq_len", "32", "--data.batch_size", "2", "--data.eval_batches", "1",
           "--data.max_documents", "80", "--checkpoint.every", "0", "--logging.progress_bar", "false"]

    def peaks(model: list[str], out) -> tuple[dict, list[int]]:
        result = swarm_cmd("peer", *run, *model, "--out", str(out), timeout=150)
        assert result.returncode == 0, result.stderr[-3000:]
        (peer,) = json.loads((out / "summary.json").read_text())["peers"]
        return peer, [json.loads(p.read_text())["peak_rss_bytes"] for p in sorted((out / "ranks").glob("rank-*.json"))]

    _, constant = peaks(EMPTY_MODEL, tmp_path / "empty")
    peer, peak = peaks(STATE_MODEL, tmp_path / "state")
    cfg = load_config(ROOT / "configs" / "tiny.yaml", STATE_MODEL)
    state = 24 * count_parameters(build_model(cfg.model, build_tokenizer(cfg.data).vocab_size, device="meta"))
    assert state > 400 * 2**20
    assert peer["rounds_completed"] == 1 and peer["rounds"][0]["committed"], peer["rounds"]
    over = [p - c for p, c in zip(peak, constant, strict=True)]  # measured: 0.56 of the state on each rank
    assert len(over) == 2 and all(0 < o < 0.75 * state for o in over), (over, state)


def test_a_sharded_warm_start_reads_each_rank_s_rows_and_trains_like_one_process(tmp_path, swarm_cmd):
    """`model.pretrained` on K = 2 fsdp ranks: the model is built on the meta device from the folder's config,
    sharded, and each rank keeps its rows of each tensor read from the safetensors (swarm/state/pretrained.py):
    it trains as one process started from the same folder does (up to float rounding, as K = 2 does)."""
    cfg = tiny_config(**SECTIONS)
    folder = tmp_path / "model"
    build_model(dataclasses.replace(cfg.model, seed=7), build_tokenizer(cfg.data).vocab_size).save_pretrained(folder)
    assert list(folder.glob("*.safetensors"))
    sections = {**SECTIONS, "model": {**SECTIONS["model"], "pretrained": str(folder)}}
    one = Trainer(tiny_config(**sections), SoloAverager(), "solo", shard=0, out_dir=tmp_path / "one").train()
    out = tmp_path / "two"
    result = swarm_cmd("peer", "--config", "configs/tiny.yaml", "--solo", "--nproc-per-node", "2", "--out", str(out),
                       "--inner.parallel", "fsdp", *overrides(SECTIONS), "--model.pretrained", str(folder),
                       timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    (peer,) = json.loads((out / "summary.json").read_text())["peers"]
    assert peer["train_loss"] == pytest.approx([r.train_loss for r in one.rounds], abs=1e-5)
    assert peer["eval_loss"] == pytest.approx([r.eval_loss for r in one.rounds], abs=1e-5)


@pytest.mark.parametrize("spec, count, plan", [
    ("2", 3, [(2, None)] * 3),
    ("1,2:fsdp,2:ddp", 3, [(1, None), (2, "fsdp"), (2, "ddp")]),
    ("1, 4:fsdp", 2, [(1, None), (4, "fsdp")]),
])
def test_a_local_swarm_takes_ranks_per_peer(spec, count, plan):
    assert parse_ranks(spec, count) == plan


@pytest.mark.parametrize("spec, count, error", [
    ("1,2", 3, "2 entries for 3 peers"),
    ("2:zero", 1, "'2:zero' is not K, K:ddp or K:fsdp"),
    ("0", 2, "'0' is not K"),
])
def test_a_local_swarm_refuses_ranks_that_do_not_parse(spec, count, error):
    with pytest.raises(UsageError, match=error):
        parse_ranks(spec, count)


def local_swarm_of_ranks(swarm_cmd, out, peers: int, ranks: str, delay: int = 0) -> tuple[dict[str, dict], str]:
    """A `swarm local` of `peers` peers and a joiner at round 2, their ranks `ranks` (--nproc-per-node), 3 rounds
    of 3 inner steps, each exchange `delay` inner steps behind: its peers' summaries by name and the one hash they
    all end on (checked on every rank of every peer)."""
    result = swarm_cmd("local", "--config", "configs/tiny.yaml", "--peers", str(peers), "--join", "2",
                       "--nproc-per-node", ranks, "--rounds", "3", "--no-monitor", "--out", str(out), *SMALL,
                       "--diloco.inner_steps", "3", "--diloco.delay", str(delay), "--data.batch_size", "4",
                       "--checkpoint.every", "0", timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = {p["name"]: p for p in json.loads((out / "summary.json").read_text())["peers"]}
    (final,) = {p["final_global_sha256"] for p in summaries.values()}
    claims = [e for p in summaries.values() for e in p["events"] if e["event"].endswith("_claim")]
    assert not claims, claims  # nobody lies here: no record may be taken for a false claim
    for name, peer in summaries.items():
        if peer["nproc"] > 1:
            hashes = [json.loads(p.read_text())["global_sha256"] for p in (out / name / "ranks").glob("*.json")]
            assert hashes == [final] * peer["nproc"], name
    return summaries, final


def test_a_mixed_swarm_of_sharded_and_unsharded_peers_commits_one_hash(tmp_path, swarm_cmd):
    """One single-process peer, one of two FSDP ranks, one of two DDP ranks: the same canonical layout, one group,
    one hash on every rank of every peer (blocking rounds; the next test runs delayed ones). A peer of two FSDP
    ranks joins at round 2: it takes a donor's whole state (gathered from the shards of a sharded donor, or an
    unsharded one's) into its own shards, and ends on the same hash."""
    peers, _ = local_swarm_of_ranks(swarm_cmd, tmp_path, 3, "1,2:fsdp,2:ddp,2:fsdp")
    assert [peers[f"peer-{i}"]["nproc"] for i in range(4)] == [1, 2, 2, 2]
    assert all(p["rounds_completed"] == 3 for p in peers.values()), peers
    assert peers["peer-1"]["rounds"][0]["group_size"] == 3
    assert "state_downloaded" in [e["event"] for e in peers["peer-3"]["events"]]


def test_a_peer_of_two_ranks_takes_the_state_of_a_peer_of_four(tmp_path, swarm_cmd):
    """Resharding by the canonical layout: the only donor shards its state over four FSDP ranks, the joiner over
    two; the state travels whole, so the joiner's two ranks end on the donor's hash, and the two average on. Each
    exchange runs behind the next inner step, as the shipped configs' do (a tenth of H, here 1 of 3)."""
    peers, _ = local_swarm_of_ranks(swarm_cmd, tmp_path, 1, "4:fsdp,2:fsdp", delay=1)
    assert [peers[name]["nproc"] for name in ("peer-0", "peer-1")] == [4, 2]
    (download,) = [e for e in peers["peer-1"]["events"] if e["event"] == "state_downloaded"]
    assert download["donor"] == peers["peer-0"]["peer_id"]
    assert peers["peer-1"]["rounds"][-1]["group_size"] == 2


def test_a_killed_sharded_peer_resumes_exactly_and_its_checkpoint_reshards(tmp_path, swarm_cmd):
    """Each rank writes its rows (pieces of one checkpoint); a rank killed mid-round takes the peer down, and the
    rerun resumes from the last complete checkpoint: one hash on both ranks, the losses of one process. That
    checkpoint read by one process (whole tensors from two ranks' pieces) is the same bytes, and exports."""
    sections = {**SECTIONS, "diloco": {"rounds": 3, "inner_steps": 3}, "checkpoint": {"every": 1}}
    out = tmp_path / "two"
    cmd = ["peer", "--config", "configs/tiny.yaml", "--solo", "--nproc-per-node", "2", "--out", str(out),
           "--inner.parallel", "fsdp", *overrides(sections)]
    killed = swarm_cmd(*cmd, "--faults.kill_round", "3", "--faults.kill_rank", "1", timeout=120)
    assert killed.returncode != 0 and not (out / "summary.json").exists()
    index = json.loads(next((out / "checkpoint").glob("round-*/index.json")).read_text())
    assert {p["file"] for p in index["tensors"]["global.model.embed_tokens.weight"]["pieces"]} == {
        "global-00001-of-00002.safetensors", "global-00002-of-00002.safetensors"}
    resumed = swarm_cmd(*cmd, timeout=120)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    (peer,) = json.loads((out / "summary.json").read_text())["peers"]
    hashes = [json.loads(p.read_text())["global_sha256"] for p in sorted((out / "ranks").glob("rank-*.json"))]
    assert hashes == [peer["final_global_sha256"]] * 2
    one = Trainer(tiny_config(**sections), SoloAverager(), "solo", shard=0, out_dir=tmp_path / "one").train()
    assert peer["train_loss"] == pytest.approx([r.train_loss for r in one.rounds], abs=1e-5)

    alone = tmp_path / "alone"
    shutil.copytree(out / "checkpoint", alone / "checkpoint")
    reader = Trainer(tiny_config(**sections), SoloAverager(), "alone", shard=0, out_dir=alone)
    assert reader.train().final_global_sha256 == peer["final_global_sha256"]
    exported = load_file(export_hf(out, tmp_path / "hf") / "model.safetensors")
    for name, p in reader.model.named_parameters():
        assert torch.equal(exported[name], p.detach()), name


def test_the_30b_recipe_is_its_accounting_on_the_meta_device():
    """configs/llama-30b.yaml's architecture, built on the meta device (no memory), has the parameters and blocks
    swarm/train/accounting.py counts, and the memory table of its comments: a sharded peer of 8 ranks fits 80 GB GPUs,
    an unsharded one does not; at 1 Gbit/s its delayed fragments hide the exchange."""
    cfg = load_config(ROOT / "configs" / "llama-30b.yaml")
    shapes = accounting.shapes_of(cfg, 256)
    model = build_model(cfg.model, 256, cfg.data.tokenizer, "meta")
    blocks = find_blocks(model)
    assert count_parameters(model) == shapes.params and 32e9 < shapes.params < 33e9
    assert len(blocks) == 60 and max(count_parameters(b) for b in blocks) == shapes.block_params
    gib = {k: round(v / 2**30, 1) for k, v in accounting.memory(cfg, shapes, 8, 256).items()}
    assert gib == {"device_per_rank": 66.9, "host_per_rank": 32.0, "host_per_node": 255.8, "page_cache": 481.5}
    unsharded = dataclasses.replace(cfg, inner=dataclasses.replace(cfg.inner, parallel="ddp"))
    assert accounting.memory(unsharded, shapes, 8, 256)["device_per_rank"] > 400 * 2**30
    step = accounting.step_seconds(cfg, shapes.params, 8, 989e12, 0.4)
    projected = accounting.round_projection(cfg, shapes.params, step, 125e6, 4)
    assert round(step, 1) == 21.4 and round(projected["comm_s"]) == 206
    assert round(projected["utilization_blocking"], 3) == 0.912 and projected["utilization_delayed"] == 1.0


def test_a_state_that_is_not_the_canonical_layout_is_refused_before_a_byte_is_written():
    """What a sharded peer takes from a donor of any K: the whole tensors of swarm/state/peerstate.py, checked by name, dtype
    and whole shape (a donor's rows, or another model's tensors, are refused naming the first that differs)."""
    cfg = tiny_config()
    model = build_model(cfg.model, 256)
    diloco = DiLoCo(model, cfg.outer)
    whole = shard_state.canonical_specs(diloco, momentum=True, adam=True)
    shard_state.check(diloco, whole)
    assert whole[0] == TensorSpec("global.0", "float32", tuple(model.model.embed_tokens.weight.shape))
    rows = [TensorSpec(s.name, s.dtype, (s.shape[0] // 2, *s.shape[1:])) if s.shape else s for s in whole]
    with pytest.raises(ValueError, match=r"tensor 0 is global.0 float32 \[128, 32\], expected global.0 float32 "
                                         r"\[256, 32\] \(the canonical layout\)"):
        shard_state.check(diloco, rows)
    with pytest.raises(ValueError, match="the state holds 9 tensors, expected"):
        shard_state.check(diloco, whole[:9])
