"""Bad data input at the command line (`swarm data prepare`, `sim`, `local`, `join`): one line naming the culprit,
exit 2 for what the user gave, 1 for files the world damaged; a damaged corpus is never trained on."""

import os

import pytest

from peers.prepare import check_corpus_here, prepare_command
from swarm.errors import UsageError
from swarm.run.configfile import load_config
from tests.conftest import ROOT
from tests.test_cli_errors import one_line_error

pytestmark = pytest.mark.timeout(90)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def prepare(cli, tmp_path, *extra):
    return cli("data", "prepare", "--config", "configs/tiny.yaml", "--data.cache_dir", str(tmp_path / "cache"), *extra)


def lines(tmp_path, n=80):
    (tmp_path / "txt").mkdir(exist_ok=True)
    (tmp_path / "txt" / "a.txt").write_text("".join(f"line {i} of a small corpus for tests\n" for i in range(n)))
    return ["--data.source", "hf", "--data.dataset", str(tmp_path / "txt")]


def test_a_corpus_path_that_does_not_exist_exits_2_naming_it(cli, tmp_path):
    result = prepare(cli, tmp_path, "--data.source", "hf", "--data.dataset", str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert f"cannot read dataset {tmp_path / 'nowhere'}: no such file or directory" in one_line_error(result)


def test_records_without_the_text_field_exit_2_naming_it(cli, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"body": "one"}\n{"body": "two"}\n')
    result = prepare(cli, tmp_path, "--data.source", "hf", "--data.dataset", str(tmp_path / "d.jsonl"))
    assert result.returncode == 2
    assert "records have no field 'text' (fields: ['body'])" in one_line_error(result)


def test_a_tokenizer_larger_than_the_model_s_vocabulary_exits_2_naming_both(cli, tmp_path):
    result = prepare(cli, tmp_path, "--model.vocab_size", "100")
    assert result.returncode == 2
    assert "data.tokenizer bytes has 256 symbols, more than model.vocab_size 100" in one_line_error(result)


def test_truncated_tampered_and_unreadable_token_files_exit_1_naming_the_folder(cli, tmp_path):
    data = lines(tmp_path)
    assert prepare(cli, tmp_path, *data).returncode == 0
    folder = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    tokens = (folder / "train.bin").read_bytes()
    (folder / "train.bin").write_bytes(tokens[:-3])
    result = prepare(cli, tmp_path, *data)
    assert result.returncode == 1 and f"prepared corpus {folder} is unreadable: train.bin holds" in one_line_error(result)
    (folder / "train.bin").write_bytes(tokens[:-3] + b"abc")  # the same size: caught by its hash
    result = cli("sim", "--config", "configs/tiny.yaml", "--data.cache_dir", str(tmp_path / "cache"), *data,
                 "--out", str(tmp_path / "sim"))
    assert result.returncode == 1 and f"prepared corpus {folder} fails its hash" in one_line_error(result)
    assert not (tmp_path / "sim" / "summary.json").exists()  # not trained on
    (folder / "meta.json").write_text("{not json")
    result = prepare(cli, tmp_path, *data)
    assert result.returncode == 1 and f"prepared corpus {folder} is unreadable" in one_line_error(result)


@pytest.mark.parametrize("command", [["sim", "--replicas", "3"], ["local", "--peers", "2", "--join", "2"]])
def test_fewer_shards_than_the_peers_that_need_one_exits_2(cli, command):
    result = cli(*command, "--config", "configs/tiny.yaml", "--data.num_shards", "2")
    assert result.returncode == 2
    assert "need" in one_line_error(result) and "data.num_shards is 2" in one_line_error(result)


def test_a_joiner_without_the_run_s_corpus_fetches_it_or_is_told_how_to_get_it(tmp_path):
    """A joiner whose dataset is not here fetches the corpus from the run's peers (peers/corpus_fetch.py); one whose
    tokenizer is not here, or a dry run (which fetches nothing), is told what to do; one whose dataset is here
    prepares it first."""
    cfg = load_config("configs/tiny.yaml", {"data": {"source": "hf", "dataset": str(tmp_path / "corpus"),
                                                     "cache_dir": str(tmp_path / "cache"), "seed": 3}}).data
    assert check_corpus_here(cfg, "run-x", "ab" * 32) is True
    with pytest.raises(UsageError) as refused:
        check_corpus_here(cfg, "run-x", "ab" * 32, dry_run=True)
    assert str(refused.value) == (
        f"run 'run-x' trains on corpus sha256 {'ab' * 8}, from dataset {tmp_path / 'corpus'}, which is not on this "
        f"machine: a join fetches it from the run's peers, a dry run fetches nothing (or join with --data.dataset "
        f"PATH, this machine's copy of it, or prepare it ahead with: {prepare_command(cfg)})")
    assert prepare_command(cfg) == (f"swarm data prepare --data.source hf --data.dataset {tmp_path / 'corpus'} "
                                    f"--data.seed 3 --data.cache_dir {tmp_path / 'cache'}")
    tok = load_config("configs/tiny.yaml", {"data": {"tokenizer": str(tmp_path / "tok")}}).data
    with pytest.raises(UsageError, match=f"tokenized by {tmp_path / 'tok'}, which is not on this machine: join with "
                                         f"--data.tokenizer PATH"):
        check_corpus_here(tok, "run-x", "ab" * 32)
    lines(tmp_path)
    (tmp_path / "txt").rename(tmp_path / "corpus")
    assert check_corpus_here(cfg, "run-x", "ab" * 32) is False  # on this machine: prepared first, as the command would


@pytest.mark.parametrize("command", [["data", "prepare"], ["peer", "--solo", "--dry-run"]])
def test_an_unwritable_cache_folder_exits_2_naming_it(cli, tmp_path, command):
    """It used to end in a traceback from deep inside prepare (FileNotFoundError on mkdir)."""
    file = tmp_path / "a-file"
    file.write_text("not a folder")
    result = cli(*command, "--config", "configs/tiny.yaml", "--data.cache_dir", str(file / "cache"))
    assert result.returncode == 2
    assert f"error: cannot write prepared corpora in {file / 'cache'} (Not a directory)" in one_line_error(result)
    assert "--data.cache_dir DIR" in one_line_error(result)


@pytest.mark.parametrize("recipe", ["llama-150m", "llama-1b", "llama-30b"])
def test_a_recipe_naming_a_real_corpus_it_cannot_find_exits_2_with_the_command_that_prepares_it(cli, recipe):
    """The recipes name C4 and LLaMA's tokenizer: a peer on a machine where that corpus is not prepared used to
    start downloading it (or, before, trained on the embedded toy corpus, which the recipes named); it now exits 2
    with the `swarm data prepare` command, which prepares exactly the corpus the peer looks for."""
    from swarm.data.tokens import corpus_key
    from swarm.run import cliargs

    result = cli("peer", "--config", f"configs/{recipe}.yaml", "--solo")
    assert result.returncode == 2
    line = one_line_error(result)
    assert line.startswith("swarm: error: data.dataset allenai/c4 is not prepared on this machine, and a peer "
                           "downloads no corpus itself: prepare it once (it downloads and tokenizes it, for every peer "
                           "here) with: swarm data prepare ")
    args, rest = cliargs.parse(line.split(" with: swarm ")[1].split())
    assert (args.command, args.data_command, args.config) == ("data", "prepare", None)
    recipe_cfg = load_config(ROOT / "configs" / f"{recipe}.yaml")
    assert corpus_key(load_config(None, rest).data) == corpus_key(recipe_cfg.data)
    assert recipe_cfg.data.source == "hf" and recipe_cfg.model.vocab_size == 32000
