"""Resume by running the same command: a peer's folder is stable by default (runs/<run>/<peer>), the same
command after Ctrl-C resumes from its checkpoint, `--fresh` starts over, the first log line says which; a second
process never shares a folder. And `swarm export --from-swarm`: the swarm's committed state as an HF folder."""

import json
import logging
import os
import re
import signal
import socket
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from peers.children import spawn_child
from peers.folder import claim, peer_name
from swarm.cli import main
from swarm.data.batches import TrainBatches, load_corpus
from swarm.errors import SwarmError
from swarm.net.identity import load_identity
from swarm.run.configfile import load_config
from swarm.state.checkpoint import Checkpointer
from tests.conftest import ROOT
from tests.swarm_harness import SMALL, local_swarm

TINY = ["--config", str(ROOT / "configs" / "tiny.yaml"), *SMALL, "--diloco.inner_steps", "3"]


def test_a_derived_folder_in_use_gives_way_and_a_named_or_given_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = claim(None, "my run", None, "solo")
    second = claim(None, "my run", None, "solo")
    assert (str(first.path), str(second.path)) == ("runs/my_run/solo", "runs/my_run/solo-2")
    with pytest.raises(SwarmError, match=r"peer folder runs/my_run/solo is in use by process \d+: stop it"):
        claim("runs/my_run/solo", "my run", None, "solo")
    peer = claim(None, "r", "a", "peer")
    assert (str(peer.path), peer.name) == ("runs/r/a", "a")
    with pytest.raises(SwarmError, match="peer a of run 'r' is running already"):
        claim(None, "r", "a", "peer")
    assert str(claim(None, "r", None, "local").path) == "runs/r"  # swarm local: its peers in runs/r/peer-<i>
    for folder in (first, second, peer):
        folder.__exit__()
    assert str(claim(None, "my run", None, "solo").path) == "runs/my_run/solo"  # free again


def test_two_peers_on_machines_of_one_hostname_get_two_names_and_two_batch_orders(tmp_path, monkeypatch):
    """Two machines called `ubuntu` (one hostname, two peer folders, so two keys): the default name was the hostname,
    so both drew one batch order and found one lease. Now each is named by the key its folder keeps, and keeps that
    name when it restarts."""
    monkeypatch.setattr(socket, "gethostname", lambda: "ubuntu")
    for machine in "ab":
        (tmp_path / machine).mkdir()
    names = [peer_name(None, load_identity(str(tmp_path / m / "identity.key")).peer_id.to_base58()) for m in "ab"]
    again = peer_name(None, load_identity(str(tmp_path / "a" / "identity.key")).peer_id.to_base58())
    assert names[0] != names[1] and all(n.startswith("ubuntu-") for n in names) and again == names[0]
    assert peer_name("p", load_identity(str(tmp_path / "a" / "identity.key")).peer_id.to_base58()) == "p"
    cfg = load_config(None, {"data": {"num_shards": 1}}).data
    corpus = load_corpus(cfg)
    first = [TrainBatches(corpus, cfg, 0, identity=name).next_batch() for name in names]
    assert not torch.equal(first[0], first[1])


def first_line(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.name == "swarm.folder")


@pytest.mark.timeout(240)
def test_a_solo_peer_stopped_by_ctrl_c_resumes_when_the_same_command_runs_again(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    hold = tmp_path / "hold"
    hold.touch()
    argv = ["peer", "--solo", *TINY, "--diloco.rounds", "2", "--faults.hold_round", "2", "--faults.hold_file",
            str(hold)]
    folder = tmp_path / "runs" / "swarm-tiny" / "solo"

    def ctrl_c_once_round_1_is_saved() -> None:
        deadline = time.time() + 120
        while not (folder / "checkpoint" / "round-000001").exists() and time.time() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    # CI may start the suite with SIGINT ignored (a background job of a shell without job control inherits
    # SIG_IGN, and Python then installs no KeyboardInterrupt handler): Ctrl-C is what this test is about.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=ctrl_c_once_round_1_is_saved, daemon=True).start()
    try:
        with pytest.raises(SystemExit) as exit:
            main(argv)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert exit.value.code == 130
    assert first_line(caplog) == "peer folder runs/swarm-tiny/solo: starting fresh (no checkpoint there)"
    hold.unlink()
    caplog.clear()
    with pytest.raises(SystemExit) as exit:
        main(argv)  # the same command
    assert exit.value.code == 0
    assert first_line(caplog) == ("peer folder runs/swarm-tiny/solo: resuming from its checkpoint of round 1, "
                                  "runs/swarm-tiny/solo/checkpoint/round-000001 (--fresh starts over)")
    meta = Checkpointer(folder / "checkpoint").read_meta()
    assert meta["round"] == 2 and [r["round"] for r in meta["history"]["rounds"]] == [1, 2]
    caplog.clear()
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--fresh", "--diloco.rounds", "1"])
    assert exit.value.code == 0
    assert first_line(caplog) == ("peer folder runs/swarm-tiny/solo: starting fresh (--fresh: deleted 1 "
                                  "checkpoint(s) in runs/swarm-tiny/solo/checkpoint)")
    assert [r["round"] for r in Checkpointer(folder / "checkpoint").read_meta()["history"]["rounds"]] == [1]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.2)


@pytest.mark.slow  # starts peers
@pytest.mark.timeout(300)
def test_a_networked_peer_resumes_by_rerun_and_the_swarm_s_state_exports(tmp_path, monkeypatch, fork_server):
    """One peer of a swarm, started without --out or --name from tmp_path, commits round 1 and holds there, serving
    its state: `swarm export --from-swarm` writes that state. Stopped (SIGTERM, as Ctrl-C), the same command resumes
    it from runs/swarm-tiny/<hostname> at round 1, under the same name (its key stays in the folder), and it ends
    the run."""
    monkeypatch.chdir(tmp_path)
    hold = tmp_path / "hold"
    hold.touch()
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
    folder = tmp_path / "runs" / "swarm-tiny" / host
    with local_swarm(tmp_path, fork_server) as swarm:
        maddr = swarm.start_bootstrap()
        argv = ["peer", *TINY, "--diloco.rounds", "2", "--initial-peers", maddr, "--faults.hold_round", "2",
                "--faults.hold_file", str(hold)]
        peer = spawn_child(fork_server, "p", argv, tmp_path / "first.log")  # forked in tmp_path
        swarm.children.append(peer)
        wait_for(lambda: (folder / "checkpoint" / "round-000001").exists() or peer.proc.poll() is not None, 150,
                 "round 1's checkpoint")
        with pytest.raises(SystemExit) as exit:
            main(["export", "--from-swarm", "swarm-tiny", "--initial-peers", maddr, "--hf-out", str(tmp_path / "hf")])
        assert exit.value.code == 0, (tmp_path / "first.log").read_text()[-3000:]
        committed, _ = Checkpointer(folder / "checkpoint").load_all()
        exported = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").named_parameters())
        assert exported and all(torch.equal(p, committed[f"global.{name}"]) for name, p in exported.items())
        peer.proc.send_signal(signal.SIGTERM)
        assert peer.proc.wait(timeout=60) == 128 + signal.SIGTERM
        name = json.loads((folder / "peer.json").read_text())["name"]
        hold.unlink()
        again = spawn_child(fork_server, "p", argv, tmp_path / "again.log")  # the same command
        swarm.children.append(again)
        assert again.proc.wait(timeout=150) == 0, (tmp_path / "again.log").read_text()[-3000:]
    log = (tmp_path / "again.log").read_text().splitlines()
    assert log[0].endswith(f"swarm.folder: peer folder runs/swarm-tiny/{host}: resuming from its checkpoint of round 1, "
                           f"runs/swarm-tiny/{host}/checkpoint/round-000001; then from the swarm's state if the swarm is "
                           "further (--fresh starts over)"), log[:3]
    assert Checkpointer(folder / "checkpoint").read_meta()["round"] == 2
    key = load_identity(str(folder / "identity.key")).peer_id.to_base58()
    assert name == json.loads((folder / "peer.json").read_text())["name"] == f"{host}-{key[-6:]}"
