"""Warm start (`model.pretrained`): a run started from an exported folder continues its loss curve; peers share
the weights' hash, not their path; a folder that is not a model, or does not fit the tokenizer, exits 2."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from peers.join import check_overrides
from swarm.cli import main
from swarm.config import shared_config
from swarm.data.batches import build_tokenizer
from swarm.errors import UsageError
from swarm.run.configfile import config_from_dict
from swarm.run.runid import run_identity
from swarm.state import pretrained
from swarm.state.export import export_hf
from swarm.state.pretrained import pretrained_sha256
from swarm.train.averaging import SoloAverager
from swarm.train.model import build_model
from swarm.train.trainer import Trainer
from tests.conftest import ROOT, tiny_config


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A solo run of two rounds, and its export."""
    root = tmp_path_factory.mktemp("warm")
    trainer = Trainer(tiny_config(diloco={"rounds": 2, "inner_steps": 3}), SoloAverager(), "a", shard=0,
                      out_dir=root / "first")
    trainer.train()
    return trainer, export_hf(root / "first", root / "model")


def warm(folder, **sections):
    return tiny_config(model={"pretrained": str(folder)}, **sections)


@pytest.mark.timeout(120)
def test_a_run_warm_started_from_an_export_continues_the_loss_curve(exported, tmp_path):
    first, folder = exported
    cfg = warm(folder, diloco={"rounds": 2, "inner_steps": 3})
    second = Trainer(cfg, SoloAverager(), "b", shard=0, out_dir=tmp_path)
    second.train()
    end_of_first = first.progress.history.rounds[-1].eval_loss
    assert second.progress.history.initial_eval_loss == pytest.approx(end_of_first, abs=1e-5)  # where the first run ended
    assert end_of_first < first.progress.history.initial_eval_loss - 0.3  # (5.44 -> 4.98, seeded)
    assert second.progress.history.rounds[-1].eval_loss < end_of_first  # and it goes on down


def test_peers_share_the_weights_hash_not_their_path(exported, tmp_path):
    _, folder = exported
    copy = shutil.copytree(folder, tmp_path / "elsewhere" / "my-copy")
    here, there = run_identity(warm(folder), "corpus"), run_identity(warm(copy), "corpus")
    assert here.weights_sha256 == there.weights_sha256 == pretrained_sha256(copy)
    assert here.fingerprint == there.fingerprint != run_identity(tiny_config(), "corpus").fingerprint
    # a joiner: the manifest holds no path; it brings its own copy (a per-peer key), or is told to
    manifest = shared_config(warm(folder))
    assert "pretrained" not in manifest["model"]
    assert check_overrides("swarm-tiny", ["--model.pretrained", str(copy)]) == {"model": {"pretrained": str(copy)}}
    bare = run_identity(config_from_dict(manifest), "corpus")
    assert bare.first_difference(here) == (f"the run starts from pretrained weights (sha256 "
                                           f"{here.weights_sha256[:16]}): pass --model.pretrained DIR, this "
                                           "peer's copy of them")
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_ep"'))
    changed = run_identity(warm(copy), "corpus")  # the same weight files, another model
    assert changed.first_difference(here).startswith("model.pretrained's weights differ")


def test_a_folder_that_is_not_a_model_or_does_not_fit_the_tokenizer_exits_2_naming_it(exported, tmp_path, capsys):
    _, folder = exported
    (tmp_path / "empty").mkdir()
    (tmp_path / "no-type").mkdir()
    (tmp_path / "no-type" / "config.json").write_text("{}")
    (tmp_path / "no-weights").mkdir()
    shutil.copy(folder / "config.json", tmp_path / "no-weights")
    not_a_model = "is not a Hugging Face model folder: "
    for name, why in [("nowhere", ": no such folder (a Hugging Face model folder, e.g. one `swarm export` wrote)"),
                      ("empty", f" {not_a_model}its config.json does not read (FileNotFoundError)"),
                      ("no-type", f" {not_a_model}its config.json names no model_type"),
                      ("no-weights", f" {not_a_model}it holds no weights (*.safetensors, *.bin)")]:
        with pytest.raises(SystemExit) as exit:
            main(["peer", "--config", str(ROOT / "configs" / "tiny.yaml"), "--solo", "--out", str(tmp_path / "run"),
                  "--model.pretrained", str(tmp_path / name)])
        assert exit.value.code == 2
        assert capsys.readouterr().err.strip() == f"swarm: error: model.pretrained {tmp_path / name}{why}"
    assert not (tmp_path / "run").exists()  # refused before anything was written
    with pytest.raises(UsageError, match=f"model.pretrained {folder} has 256 embedding rows and data.tokenizer "
                                         "'gpt2' 50257 tokens: they must agree"):
        build_model(warm(folder).model, 50257, "gpt2")


def test_the_weights_hash_is_remembered_across_starts_while_the_files_keep_their_stamp(exported, tmp_path):
    """A 30B folder is 120 GB to read: a peer used to hash it at every start. The hash is now remembered by folder
    and (size, mtime) of each file: a fresh process given an unchanged folder reads no weight byte (shown here by
    bytes changed behind the stamp's back), and a file written to since is hashed again."""
    import os
    import subprocess
    import sys

    _, folder = exported
    copy = shutil.copytree(folder, tmp_path / "copy")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def hashed() -> str:
        code = f"from swarm.state.pretrained import pretrained_sha256; print(pretrained_sha256({str(copy)!r}))"
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()

    first = hashed()
    assert first == pretrained_sha256(folder)
    weights = next(copy.glob("*.safetensors"))
    stat = weights.stat()
    with open(weights, "r+b") as f:  # the same size and time, other bytes: only a reader of the bytes sees it
        f.seek(stat.st_size - 1)
        last = f.read(1)
        f.seek(stat.st_size - 1)
        f.write(bytes([last[0] ^ 1]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert hashed() == first  # remembered: not read again
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert hashed() != first  # written to since: hashed again


def test_an_embedding_that_does_not_fit_the_tokenizer_exits_2_through_the_cli(tmp_path, capsys):
    """A Llama folder of 100 embedding rows given to a run on byte tokens (256): one line naming both, exit 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "small-vocab")
    with pytest.raises(SystemExit) as exit:
        main(["peer", "--config", str(ROOT / "configs" / "tiny.yaml"), "--solo", "--out", str(tmp_path / "run"),
              "--model.pretrained", str(tmp_path / "small-vocab")])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"swarm: error: model.pretrained {tmp_path / 'small-vocab'} has 100 embedding rows and data.tokenizer "
        f"'bytes' 256 tokens: they must agree (a tokenizer of that model)")


@pytest.mark.timeout(120)
def test_a_run_warm_started_from_another_model_family_trains_and_exports_it(tmp_path):
    """Export was tested on Llama only: a GPT-2 folder (another architecture, its own weight names) warm-starts a
    solo run, which trains and exports a GPT-2 folder holding the committed global parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from swarm.state.checkpoint import Checkpointer

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=32, n_layer=2, n_head=2)).save_pretrained(
        tmp_path / "gpt2")
    cfg = warm(tmp_path / "gpt2", diloco={"rounds": 1, "inner_steps": 3})
    trainer = Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=tmp_path / "run")
    trainer.train()
    assert trainer.progress.history.rounds[-1].eval_loss < trainer.progress.history.initial_eval_loss
    out = export_hf(tmp_path / "run", tmp_path / "exported")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "gpt2"
    committed, _ = Checkpointer(tmp_path / "run" / "checkpoint").load_all()
    exported = dict(model.named_parameters())
    assert exported and all(torch.equal(p, committed[f"global.{name}"]) for name, p in exported.items())


@pytest.mark.timeout(120)
def test_torch_save_weights_are_read_a_tensor_at_a_time_as_safetensors_are(exported, tmp_path):
    """A folder of torch.save weights (pytorch_model.bin, as older transformers wrote): a sharded start (`shard`,
    here one that shards nothing) builds the model on the meta device and reads the file a tensor at a time
    through a memory map, giving the weights transformers loads whole; a *.bin of torch's legacy format (no zip,
    no map) is loaded whole and then sharded."""
    _, folder = exported
    whole = AutoModelForCausalLM.from_pretrained(folder)
    for name, legacy in (("bin", False), ("legacy", True)):
        (tmp_path / name).mkdir()
        shutil.copy(folder / "config.json", tmp_path / name)
        torch.save(whole.state_dict(), tmp_path / name / "pytorch_model.bin",
                   _use_new_zipfile_serialization=not legacy)
    for source, on_meta in ((tmp_path / "bin", True), (tmp_path / "legacy", False)):
        cfg = warm(source)
        seen = []
        model = pretrained.load(cfg.model, build_tokenizer(cfg.data).vocab_size, cfg.data.tokenizer,
                                shard=lambda m, seen=seen: seen.append(next(m.parameters()).is_meta))
        assert seen == [on_meta], source
        mine, theirs = model.state_dict(), whole.state_dict()
        assert list(mine) == list(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine), source


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_rank_reads_its_rows_of_a_tensor_and_no_others(tmp_path, kind):
    """A sharded rank's rows of a stored tensor (bf16 here, as checkpoints on the hub often are) come back in fp32
    without the whole tensor being read: a safetensors slice, or rows of a memory-mapped torch.save zip. A rank
    past the last rows (more ranks than rows) gets none; a tensor of another shape is named."""
    from safetensors.torch import save_file

    stored = torch.randn(5, 4).to(torch.bfloat16)
    path = tmp_path / f"weights.{kind}"
    save_file({"w": stored}, path) if kind == "safetensors" else torch.save({"w": stored}, path)
    with pretrained.WeightFiles([path], "folder") as weights:
        rows = weights.rows("w", (5, 4), slice(2, 4))
        assert rows.dtype == torch.float32 and torch.equal(rows, stored[2:4].float())
        assert weights.rows("w", (5, 4), slice(5, 5)).shape == (0, 4)
        with pytest.raises(UsageError, match=r"folder: tensor w is \(5, 4\), the model's \(4, 5\)"):
            weights.rows("w", (4, 5), slice(0, 2))
