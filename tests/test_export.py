"""`swarm export`: a peer's committed global parameters as a Hugging Face folder that transformers loads."""

import copy
import shutil
import subprocess
import sys
import weakref

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from swarm.cli import main
from swarm.data.batches import ByteTokenizer
from swarm.errors import UsageError
from swarm.run.configfile import config_from_dict
from swarm.state.checkpoint import Checkpointer
from swarm.state.export import export_hf, find_checkpoint, global_parameters, hf_parameters, model_of, write_hf
from swarm.state.tensorfile import read_header
from swarm.train.averaging import SoloAverager
from swarm.train.trainer import Trainer
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A solo peer's folder after two committed rounds, and its trainer."""
    out = tmp_path_factory.mktemp("peer")
    cfg = tiny_config(diloco={"rounds": 2, "inner_steps": 2})
    trainer = Trainer(cfg, SoloAverager(), "a", shard=0, out_dir=out)
    trainer.train()
    return out, trainer


def test_the_exported_folder_loads_in_transformers_and_gives_the_swarm_model_s_logits(trained, tmp_path):
    out, trainer = trained
    assert export_hf(out, tmp_path / "hf") == tmp_path / "hf"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return x + 1  # é"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == list(text.encode())  # byte tokens: the same ids as the swarm's ByteTokenizer
    assert tokenizer.decode(ids[0]) == text
    swarm_model = trainer.model
    with torch.no_grad():
        for p, g in zip(trainer.diloco.params, trainer.diloco.global_params):
            p.copy_(g)  # the committed global parameters, which the export holds
        expected = swarm_model(ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert model.generation_config.eos_token_id == 0
    generated = model.generate(**tokenizer("def ", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8)


def test_the_export_reads_and_writes_one_tensor_at_a_time(trained, tmp_path):
    """The model is built on the meta device (names, shapes, config) and each global parameter is read from the
    checkpoint, written and let go: none is still held when the next one arrives, so the exporter never holds the
    model (bench/shards.py measures its peak)."""
    out, trainer = trained
    checkpoint = find_checkpoint(out)
    meta = checkpoint.read_meta()
    with torch.device("meta"):
        skeleton = model_of(meta, config_from_dict(meta["config"]), 256, out)
    refs = []

    def watched():
        for name, tensor in global_parameters(checkpoint, skeleton):
            assert all(ref() is None for ref in refs), f"{name} read while an earlier tensor is still held"
            refs.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    write_hf(skeleton, ByteTokenizer(), tmp_path / "hf", weights=watched())
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert len(refs) == len(exported) == len(trainer.diloco.global_params)
    for name, g in zip(hf_parameters(trainer.model), trainer.diloco.global_params):
        assert torch.equal(exported[name], g), name


def test_weights_above_the_shard_size_are_sharded_as_transformers_reads_them(trained, tmp_path):
    out, trainer = trained
    model = copy.deepcopy(trainer.model)
    write_hf(model, ByteTokenizer(), tmp_path / "hf", max_shard_bytes=20_000)
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for name, p in hf_parameters(model).items():
        assert torch.equal(loaded.state_dict()[name], p.detach()), name


def test_export_refuses_a_folder_without_a_checkpoint_and_a_non_empty_target(trained, tmp_path):
    out, _ = trained
    with pytest.raises(UsageError, match=rf"no complete checkpoint in {tmp_path}"):
        export_hf(tmp_path, tmp_path / "hf")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"--hf-out .*taken exists and is not empty \(pass --force"):
        export_hf(out, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"  # nothing lost
    export_hf(out, tmp_path / "taken", dtype="bf16", force=True)
    assert not (tmp_path / "taken" / "keep.txt").exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "taken").dtype == torch.bfloat16
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no partial folder left


def test_a_corrupt_checkpoint_is_refused_naming_it_and_nothing_is_written(trained, tmp_path):
    out, _ = trained
    broken = tmp_path / "round-000002"
    shutil.copytree(out / "checkpoint" / "round-000002", broken)
    with open(broken / "global.safetensors", "rb") as f:
        at = read_header(f)[1]["global.model.norm.weight"].start  # a global parameter: what export reads
    data = (broken / "global.safetensors").read_bytes()
    (broken / "global.safetensors").write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])
    with pytest.raises(UsageError, match=r"corrupt checkpoint .*round-000002: global.model.norm.weight fails its"):
        export_hf(broken, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert Checkpointer(out / "checkpoint").read_meta()["round"] == 2


def test_cli_export_prints_where_and_how_to_load_it(trained, tmp_path, capsys):
    out, _ = trained
    with pytest.raises(SystemExit) as exit:
        main(["export", str(out), "--hf-out", str(tmp_path / "hf")])
    assert exit.value.code == 0
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'hf'}" in printed and "from_pretrained" in printed
    with pytest.raises(SystemExit) as exit:
        main(["export", str(tmp_path / "nowhere"), "--hf-out", str(tmp_path / "hf2")])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().startswith("swarm: error: no complete checkpoint in")


@pytest.mark.slow  # runs the snippet in a process of its own
def test_the_printed_snippet_runs(trained, tmp_path):
    from swarm.state.export import usage_snippet

    out, _ = trained
    export_hf(out, tmp_path / "hf")
    snippet = usage_snippet(tmp_path / "hf").replace("max_new_tokens=64", "max_new_tokens=2")
    result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("def ")


@pytest.mark.parametrize("args, error", [
    ([], "swarm export takes a SOURCE (a peer's folder) or --from-swarm RUN, one of them"),
    (["runs/x", "--from-swarm", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "swarm export takes a SOURCE"),
    (["--from-swarm", "r"], "--from-swarm RUN and --initial-peers MADDR ... go together"),
    (["runs/x", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "--from-swarm RUN and --initial-peers"),
])
def test_export_takes_a_source_or_the_swarm(args, error, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["export", *args, "--hf-out", str(tmp_path / "hf")])
    assert exit.value.code == 2 and capsys.readouterr().err.startswith(f"swarm: error: {error}")
    assert not (tmp_path / "hf").exists()
