"""The command line's rules (swarm/run/cliargs.py): help and real defaults on every option, one spelling per option,
no abbreviations, list options that stop at an override, log levels, `--version`, `config show`, `--dry-run`.

Everything here runs in this process and starts no DHT or peer: `run` calls `swarm.cli.main` like the `cli`
fixture, for commands that end before any network (the fast tier keeps them)."""

import argparse
import re

import pytest

from peers.folder import claim
from swarm.cli import main
from swarm.config import Config, joinable_keys
from swarm.errors import UsageError
from swarm.run import cliargs
from swarm.run.configfile import load_config
from tests.conftest import ROOT, CliResult

pytestmark = pytest.mark.timeout(120)
SMALL = ["--model.hidden_size", "32", "--model.num_layers", "1", "--model.num_heads", "2",
         "--model.intermediate_size", "64", "--model.max_seq_len", "32", "--data.seq_len", "32",
         "--data.max_documents", "60", "--data.eval_batches", "2", "--data.batch_size", "4"]


@pytest.fixture
def run(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)

    def call(*args: str) -> CliResult:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(list(args))
        out, err = capsys.readouterr()
        return CliResult(exited.value.code, out, err)
    return call


def one_line_error(result: CliResult) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("swarm: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return lines[0]


def commands(parser: argparse.ArgumentParser, prefix: str = "swarm"):
    """(name, parser) of every command and subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from commands(sub, f"{prefix} {name}")


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def test_every_option_has_help_and_shows_its_real_default():
    formatter = cliargs._DefaultsHelp("swarm")
    for name, parser in commands(cliargs.parser()):
        for action in options(parser):
            assert action.help, f"{name} {action.option_strings[0]} has no help text"
            text = formatter._get_help_string(action)
            if action.default not in (None, False, [], argparse.SUPPRESS):
                assert "default" in text, f"{name} {action.option_strings[0]}: {text}"
    out = {a.dest: a.help for a in options(dict(commands(cliargs.parser()))["swarm peer"])}["out"]
    default = str(claim(None, Config().swarm.run_id, None, "peer", lock=False).path)  # a peer without --out
    assert re.fullmatch(r"runs/swarm-tiny/[A-Za-z0-9._-]+", default) and "runs/<run id>/<name>" in out


def test_one_spelling_per_option():
    """An option that sets a config key is that key, or a shortcut that every command spells alike."""
    leaves = {k for section in Config().to_dict().values() for k in section}
    spellings: dict[str, set[str]] = {}
    for name, parser in commands(cliargs.parser()):
        for action in options(parser):
            for option in action.option_strings:
                spellings.setdefault(option.lstrip("-").replace("-", "_"), set()).add(option)
                if option.lstrip("-").replace("-", "_") in leaves:
                    assert option in cliargs.SHORTCUTS, f"{name} {option}: spell it as the config key it sets"
    assert all(len(s) == 1 for s in spellings.values()), spellings
    by_command = dict(commands(cliargs.parser()))
    for network in ("--initial-peers", "--port", "--announce-ip", "--client-mode"):
        for name in ("swarm peer", "swarm join"):
            assert network in {o for a in options(by_command[name]) for o in a.option_strings}, (name, network)
    boot = {o for a in options(by_command["swarm bootstrap"]) for o in a.option_strings}
    assert not {"--identity", "--host-maddrs", "--announce-maddrs"} & boot  # --swarm.identity, as everywhere


@pytest.mark.parametrize("argv, culprit", [
    (["peer", "--config", "c.yaml", "--init", "/ip4/1.2.3.4/tcp/1/p2p/QmX"], "unknown option '--init'"),
    (["peer", "--config", "c.yaml", "--initial-peers", "inner.lr=3e-4"], "--initial-peers: 'inner.lr=3e-4' is not"),
    (["peer"], "the following arguments are required: --config"),
    (["peer", "--config", "c.yaml", "--log-level", "loud"], "--log-level 'loud': not one of debug, info"),
    (["peer", "--config", "c.yaml", "-v", "-q"], "-v and -q"),
    (["join", "r", "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/QmX", "--config", "c.yaml"], "takes no --config"),
    (["bogus"], "invalid choice: 'bogus'"),
])
def test_usage_errors_are_one_line(argv, culprit):
    with pytest.raises(UsageError, match=re.escape(culprit)):
        args, _ = cliargs.parse(argv)
        cliargs.log_level(args)


def test_a_list_option_stops_at_an_override():
    peer = "/ip4/1.2.3.4/tcp/1/p2p/QmX"
    args, rest = cliargs.parse(["peer", "--config", "c.yaml", "--initial-peers", peer, "inner.lr=3e-4",
                                "--diloco.delay", "-1"])
    assert args.initial_peers == [peer] and rest == ["inner.lr=3e-4", "--diloco.delay", "-1"]
    args, rest = cliargs.parse(["join", "r", "--client-mode", "--initial-peers", peer, peer, "data.shard=3"])
    assert args.client_mode and args.initial_peers == [peer, peer] and rest == ["data.shard=3"]
    assert cliargs.log_level(cliargs.parse(["runs", "--initial-peers", peer, "-q"])[0]) == "warning"
    assert cliargs.log_level(cliargs.parse(["local", "--config", "c", "--log-level", "DEBUG"])[0]) == "debug"


COMMANDS = [["peer"], ["join"], ["runs"], ["sim"], ["local"], ["bootstrap"], ["monitor"], ["data", "prepare"],
            ["config", "show"], ["export"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_s_help_says_what_it_does_and_its_flags_mean_one_thing(command, run):
    """Every subcommand's --help: a description under the usage line; --port, where there is one, a peer's TCP
    port (the monitor's HTTP port is --http-port); every command that trains a folder has --fresh and --dry-run;
    `join` lists the keys a joiner may override."""
    result = run(*command, "--help")
    assert result.returncode == 0
    usage, description = result.stdout.split("\n\n")[:2]
    assert usage.startswith(f"usage: swarm {' '.join(command)}") and description.strip()
    flags = dict(re.findall(r"^  (--[a-z-]+)(?: [A-Z]\S*)?\s+(\S.*)$", result.stdout, re.MULTILINE))
    if "--port" in flags:
        assert flags["--port"].startswith("TCP port"), flags["--port"]
    if command[0] in ("peer", "join", "sim", "local"):
        assert "--fresh" in result.stdout and "--dry-run" in result.stdout
    if command == ["join"]:
        assert all(key in " ".join(result.stdout.split()) for key in joinable_keys())


def test_version_and_help(run):
    result = run("--version")
    assert result.returncode == 0 and re.fullmatch(r"swarm \S+\n", result.stdout)
    result = run("join", "--help")
    assert result.returncode == 0 and "--client-mode" in result.stdout and "--dry-run" in result.stdout


@pytest.mark.parametrize("argv, culprit", [
    (["--port", "70000"], "--port 70000: not a TCP port"),
    (["--announce-ip", "example.com"], "--announce-ip 'example.com': not an IP address"),
    (["--out", "/proc/no/such/folder"], "cannot write the peer folder /proc/no/such/folder (--out)"),
    (["--logging.wandb_mode", "sometimes"], "logging.wandb_mode"),
])
def test_bad_peer_options_exit_2_naming_them(argv, culprit, run):
    result = run("peer", "--config", "configs/tiny.yaml", *SMALL, *argv)
    assert result.returncode == 2
    assert culprit in one_line_error(result)


def test_a_port_in_use_exits_2_naming_it(run):
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("peer", "--config", "configs/tiny.yaml", "--port", str(port))
    assert result.returncode == 2
    assert f"--port {port}: address already in use" in one_line_error(result)


def test_join_refuses_a_run_key_listing_the_keys_it_takes(run):
    result = run("join", "swarm-tiny", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "inner.lr=3e-4")
    assert result.returncode == 2
    line = one_line_error(result)
    assert "cannot override inner.lr" in line and "diloco.device" in line and "logging.*" in line


def test_config_show_marks_per_peer_keys_and_gives_the_fingerprint(run, tmp_path):
    from swarm.run.runid import run_identity

    result = run("config", "show", "--config", "configs/tiny.yaml", *SMALL, "--diloco.inner_steps", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "  inner_steps: 5" in lines and "  delay: 0" in lines  # auto: a tenth of 5
    assert "  device: cpu  # per peer" in lines and "logging:  # per peer" in lines
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [*SMALL, "--diloco.inner_steps", "5"])
    run_identity(cfg)  # prepares the corpus, which `config show` only reads
    result = run("config", "show", "--config", "configs/tiny.yaml", *SMALL, "--diloco.inner_steps", "5")
    assert f"# fingerprint: {run_identity(cfg).fingerprint} (" in result.stdout


def test_dry_run_checks_everything_and_trains_nothing(run, tmp_path):
    key = tmp_path / "keys" / "peer.key"
    result = run("peer", "--config", "configs/tiny.yaml", *SMALL, "--out", str(tmp_path / "out"), "--dry-run",
                 "--port", "0", "--announce-ip", "10.1.2.3", "--swarm.identity", str(key))
    assert result.returncode == 0, result.stderr
    assert "corpus: " in result.stdout and "fingerprint: " in result.stdout and "created at start" in result.stdout
    assert "announces /ip4/10.1.2.3/tcp/" in result.stdout and "only private or loopback" in result.stdout
    assert not (tmp_path / "out").exists() and not key.exists()
    result = run("local", "--config", "configs/tiny.yaml", *SMALL, "--peers", "2", "--dry-run",
                 "--out", str(tmp_path / "local"))
    assert result.returncode == 0 and "nothing trained" in result.stdout and not (tmp_path / "local").exists()
    local = tmp_path / "local"  # the swarm's log beside its peers' folders, where each peer's log.txt goes
    assert (f"run folder: {local} (log.txt, bootstrap.log and bootstrap/, summary.json, loss.png); each peer's in "
            f"{local / 'peer-0'} .. {local / 'peer-1'} (log.txt, metrics.csv, checkpoint/, identity.key, ledger.json)"
            ) in result.stdout


def test_dry_run_prints_the_memory_plan_per_rank_even_where_it_cannot_run(run, tmp_path):
    """The 30B recipe on 8 ranks, asked on this CPU machine: the plan per rank first (swarm/train/accounting.py, the
    numbers of configs/llama-30b.yaml's comments), then exit 2 naming why it cannot run here."""
    result = run("peer", "--config", "configs/llama-30b.yaml", "--nproc-per-node", "8", "--dry-run",
                 "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "memory per rank (8 rank(s), inner.parallel fsdp, 32.3B parameters" in result.stdout
    assert "30.1 GiB  AdamW moments" in result.stdout and "30.1 GiB  fp32 global parameters" in result.stdout
    assert "1.9 GiB  the pseudo-gradient a delayed exchange took (float16)" in result.stdout
    assert "= 66.9 GiB on each device (cuda), 255.8 GiB of host memory" in result.stdout
    assert "--nproc-per-node 8 exceeds the 0 CUDA devices here" in result.stderr
    on_cpu = run("peer", "--config", "configs/llama-30b.yaml", "--nproc-per-node", "8", "--diloco.device", "cpu",
                 "--dry-run", "--out", str(tmp_path / "out"))
    assert on_cpu.returncode == 2 and "the plan above 791.0 GiB for 8 rank(s); its biggest item: AdamW moments" \
        in on_cpu.stderr
    eight_bit = run("peer", "--config", "configs/tiny.yaml", *SMALL, "--inner.optimizer", "adamw8bit",
                    "--dry-run", "--out", str(tmp_path / "small"))
    assert eight_bit.returncode == 0 and "AdamW moments (8-bit)" in eight_bit.stdout


def test_more_ranks_than_rows_of_a_sharded_tensor_exit_2_naming_it_before_anything_is_built(run, tmp_path):
    """`inner.parallel: fsdp` cuts every tensor by rows (swarm/train/sharding.py): 96 ranks of a model whose
    hidden size is 64 would leave ranks without a row of the final norm. Refused, naming it, before the plan."""
    argv = ["--config", "configs/tiny.yaml", "--inner.parallel", "fsdp", "--data.batch_size", "96",
            "--diloco.device", "cpu", "--dry-run", "--out", str(tmp_path / "out")]
    result = run("peer", *argv, "--nproc-per-node", "96", "--model.hidden_size", "64", "--model.num_kv_heads", "2")
    assert result.returncode == 2 and "memory per rank" not in result.stdout
    assert "--nproc-per-node 96 exceeds the 32 rows of model.layers.0.self_attn.k_proj.weight" in result.stderr
    result = run("peer", *argv, "--nproc-per-node", "96", "--model.hidden_size", "64")
    assert result.returncode == 2 and "exceeds the 64 rows of model.norm.weight (model.hidden_size)" in result.stderr


@pytest.mark.timeout(120)
def test_sim_takes_dry_run_and_fresh_as_the_other_training_commands_do(run, tmp_path):
    """`swarm sim` had neither: --dry-run checks and trains nothing; run again on the same --out it resumes its
    replicas from their checkpoints, and --fresh deletes them first."""
    argv = ["sim", "--config", "configs/tiny.yaml", *SMALL, "--replicas", "2", "--diloco.rounds", "1",
            "--diloco.inner_steps", "2", "--inner.warmup_steps", "1", "--out", str(tmp_path / "sim")]
    dry = run(*argv, "--dry-run")
    assert dry.returncode == 0 and "nothing trained" in dry.stdout and not (tmp_path / "sim").exists()
    assert run(*argv).returncode == 0
    checkpoint = tmp_path / "sim" / "replica-0" / "checkpoint"
    assert any(checkpoint.iterdir())
    again = run(*argv, "--fresh")
    assert again.returncode == 0
    log = (tmp_path / "sim" / "log.txt").read_text()
    assert f"peer folder {tmp_path / 'sim' / 'replica-0'}: starting fresh (--fresh: deleted" in log
