"""Run manifests, `swarm join RUN` and `swarm runs`: the per-peer keys, the manifest's checks, and a real
joiner that starts from the DHT alone and ends on the creator's parameters."""

import contextlib
import dataclasses
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer
from pydantic.v1 import ValidationError

from peers.children import spawn_child
from peers.join import _count, check_overrides, describe_run, format_runs, write_config
from swarm.config import PER_PEER_KEYS, Config, is_per_peer
from swarm.errors import UsageError
from swarm.net import schema
from swarm.net.identity import load_identity
from swarm.net.manifest import ManifestRefused, check_manifest, choose_manifest, shared_config
from swarm.net.schema import CommitRecord, IndexRecord, ManifestRecord, ProgressRecord, RunRecord
from swarm.run.configfile import config_from_dict, load_config
from swarm.run.runid import RunIdentity, run_identity
from swarm.train.model import build_model, count_parameters
from tests.conftest import tiny_config
from tests.swarm_harness import local_swarm

CORPUS = "c0ffee"  # a corpus hash: these manifests are never trained on


def fingerprint(cfg: Config) -> str:
    return RunIdentity(shared_config(cfg), CORPUS).fingerprint


def test_every_per_peer_key_names_a_config_key():
    sections = Config().to_dict()
    for key in PER_PEER_KEYS:
        section, _, name = key.partition(".")
        assert section in sections and (not name or name in sections[section]), key


@pytest.mark.parametrize("key,per_peer", [
    ("diloco.device", True), ("diloco.threads", True), ("inner.micro_batch_size", True), ("data.shard", True),
    ("checkpoint.dir", True), ("logging.progress_bar", True), ("faults.kill_round", True),
    ("swarm.identity", True), ("swarm.initial_peers", True), ("swarm.host_maddrs", True),
    ("model.hidden_size", False), ("inner.lr", False), ("inner.precision", False), ("diloco.rounds", False),
    ("diloco.inner_steps", False), ("data.batch_size", False), ("swarm.run_id", False),
    ("swarm.min_group_size", False), ("swarm.auth", False),
])
def test_per_peer_keys(key, per_peer):
    assert is_per_peer(key) == per_peer


def _shared_leaves(cfg: Config) -> dict:
    return {f"{s}.{k}": v for s, values in cfg.to_dict().items() for k, v in values.items()
            if not is_per_peer(f"{s}.{k}")}


def test_a_manifest_omits_per_peer_keys_and_reloads_to_the_same_run():
    cfg = tiny_config(diloco={"device": "cpu", "threads": 1}, checkpoint={"dir": "/tmp/x"}, data={"shard": 3})
    shared = shared_config(cfg)
    assert not {"checkpoint", "logging", "faults"} & set(shared)
    assert "device" not in shared["diloco"] and "shard" not in shared["data"] and "identity" not in shared["swarm"]
    assert shared["model"]["hidden_size"] == 32 and shared["diloco"]["rounds"] == 3
    loaded = config_from_dict(json.loads(json.dumps(shared)))
    assert fingerprint(loaded) == fingerprint(cfg)
    assert _shared_leaves(loaded) == _shared_leaves(cfg)
    assert len(json.dumps(shared)) < schema.MAX_MANIFEST_BYTES // 4


def _manifest(cfg: Config, signed: float = 1.0, **fields) -> ManifestRecord:
    values = dict(config=shared_config(cfg), fingerprint=fingerprint(cfg), creator="creator", time=signed,
                  version=schema.MANIFEST_VERSION, corpus_sha256=CORPUS)
    return ManifestRecord(**{**values, **fields})


def test_check_manifest_refuses_what_does_not_reproduce_the_run():
    cfg = tiny_config()
    fp = fingerprint(cfg)
    assert fingerprint(check_manifest("swarm-tiny", _manifest(cfg), fp)) == fp
    with pytest.raises(ManifestRefused, match=f"fingerprint {fp}, the run's peers signed 0123"):
        check_manifest("swarm-tiny", _manifest(cfg), "0123")
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=64))
    forged = _manifest(wider, fingerprint=fp)  # claims the run's fingerprint, holds another model
    with pytest.raises(ManifestRefused, match=f"its config gives fingerprint {fingerprint(wider)}, not the run's"):
        check_manifest("swarm-tiny", forged, fp)
    with pytest.raises(ManifestRefused, match="its config gives fingerprint"):  # another corpus than it claims
        check_manifest("swarm-tiny", _manifest(cfg, corpus_sha256="beef"), fp)
    unknown = _manifest(cfg)
    unknown.config["model"]["flash"] = True  # a key a newer version may know
    with pytest.raises(ManifestRefused, match="cannot read its config.*unknown config key 'model.flash'"):
        check_manifest("swarm-tiny", unknown, fp)
    sneaky = _manifest(cfg)
    sneaky.config["faults"] = {"kill_round": 1}
    with pytest.raises(ManifestRefused, match="it sets faults, which is each peer's own"):
        check_manifest("swarm-tiny", sneaky, fp)
    sneaky = _manifest(cfg)
    sneaky.config["swarm"]["identity"] = "/etc/key"
    with pytest.raises(ManifestRefused, match="it sets swarm.identity"):
        check_manifest("swarm-tiny", sneaky, fp)
    with pytest.raises(ManifestRefused, match="its config is for run 'swarm-tiny'"):
        check_manifest("other", _manifest(cfg), fp)
    with pytest.raises(ManifestRefused, match=f"manifest version {schema.MANIFEST_VERSION + 1} is newer"):
        check_manifest("swarm-tiny", _manifest(cfg, version=schema.MANIFEST_VERSION + 1), fp)


def test_the_manifest_of_the_run_s_fingerprint_wins():
    cfg = tiny_config()
    fp = fingerprint(cfg)
    other_lr = dataclasses.replace(cfg, inner=dataclasses.replace(cfg.inner, lr=0.5))
    assert fingerprint(other_lr) != fp  # every run key is in the fingerprint
    honest = {"a": _manifest(cfg, 2.0), "b": _manifest(cfg, 3.0)}
    stranger = {"s": _manifest(other_lr, 1.0, fingerprint=fp)}  # signed earliest, claims the run's fingerprint
    choice = choose_manifest("swarm-tiny", {**honest, **stranger}, fp)
    assert choice.signers == ["a", "b"] and choice.config.inner.lr == cfg.inner.lr and choice.record.time == 2.0
    assert choice.run.fingerprint == fp and choice.run.corpus_sha256 == CORPUS
    alone = choose_manifest("swarm-tiny", {"a": _manifest(cfg, 2.0), **stranger}, fp)
    assert alone.signers == ["a"]  # one each, but the stranger's does not reproduce the fingerprint
    bad = _manifest(cfg, fingerprint="0123")
    assert choose_manifest("swarm-tiny", {"a": _manifest(cfg), "x": bad}, fp).signers == ["a"]
    with pytest.raises(ManifestRefused, match="manifest of run 'swarm-tiny' refused: it is for fingerprint 0123"):
        choose_manifest("swarm-tiny", {"x": bad}, fp)
    with pytest.raises(ManifestRefused, match="has no manifest"):
        choose_manifest("swarm-tiny", {}, fp)
    with pytest.raises(ManifestRefused, match="no peer of run 'swarm-tiny' signed its fingerprint"):
        choose_manifest("swarm-tiny", honest, None)


def test_a_manifest_is_bounded_and_passes_the_dht_schema():
    cfg = tiny_config()
    with pytest.raises(ValidationError, match="over 16384"):
        _manifest(cfg, config={"data": {"dataset": "x" * schema.MAX_MANIFEST_BYTES}})
    owner = load_identity(None).owner
    validator = SchemaValidator(schema.RunSchema, prefix="swarm-tiny")
    validator.merge_with(SchemaValidator(schema.IndexSchema))

    def record(key: str, value: dict, subkey: bytes = owner) -> DHTRecord:
        return DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                         MSGPackSerializer.dumps(value), 0.0)

    assert validator.validate(record("swarm-tiny_manifest", _manifest(cfg).dict()))
    assert not validator.validate(record("swarm-tiny_manifest", _manifest(cfg).dict(), subkey=b"creator"))
    assert not validator.validate(record("swarm-tiny_manifest", {**_manifest(cfg).dict(), "version": 1.0}))
    entry = IndexRecord(run_id="swarm-tiny", fingerprint="ab", params=10, time=1.0).dict()
    assert validator.validate(record(schema.INDEX_KEY, entry))
    assert not validator.validate(record(schema.INDEX_KEY, {**entry, "params": -1}))
    assert not validator.validate(record(schema.INDEX_KEY, {**entry, "run_id": "r" * 129}))


def test_join_overrides_only_per_peer_keys():
    assert check_overrides("r", ["--diloco.threads", "2", "checkpoint.dir=/x", "--faults.hold_round", "1"]) == {
        "diloco": {"threads": 2}, "checkpoint": {"dir": "/x"}, "faults": {"hold_round": 1}}
    with pytest.raises(UsageError, match="cannot override model.hidden_size when joining run 'r': it is fixed by"):
        check_overrides("r", ["--diloco.threads", "2", "--model.hidden_size", "64"])
    with pytest.raises(UsageError) as refused:  # the keys it takes, listed, not a Python name
        check_overrides("r", ["--inner.lr", "3e-4"])
    assert ("a joiner may set only checkpoint.*, data.cache_dir, data.dataset, data.dataset_config, "
            "data.prepare_workers, data.shard, data.split, data.streaming, data.text_field, data.tokenizer, "
            "diloco.device,") in str(refused.value)
    # where its copy of the corpus lies: the content is the run's (its hash), the path its own
    assert check_overrides("r", ["--data.dataset", "/my/copy"]) == {"data": {"dataset": "/my/copy"}}
    assert "PER_PEER_KEYS" not in str(refused.value)
    with pytest.raises(UsageError, match="swarm join takes no --config"):
        check_overrides("r", ["--config", "configs/tiny.yaml"])
    # a demand on the manifest's signers (swarm.identity_work), not a change to the run's config
    assert check_overrides("r", ["--swarm.identity_work", "12"]) == {"swarm": {"identity_work": 12}}


def test_a_joined_config_written_for_torchrun_reloads_the_same(tmp_path):
    cfg = tiny_config(swarm={"initial_peers": ["/ip4/1.2.3.4/tcp/5/p2p/QmX"]}, inner={"eps": 1e-8})
    path = write_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(path).to_dict() == cfg.to_dict()


def test_describe_run_takes_majorities():
    now = 1000.0

    def progress(round: int, age: float) -> ProgressRecord:
        return ProgressRecord(peer_id="p", name="n", round=round, inner_step=0, samples=0, samples_per_s=0.0,
                              time=now - age, serves_state=True)

    cfg = tiny_config()
    fp = fingerprint(cfg)
    entries = {"a": IndexRecord(run_id="r", fingerprint=fp, params=100, time=1.0),
               "b": IndexRecord(run_id="r", fingerprint=fp, params=100, time=2.0),
               "s": IndexRecord(run_id="r", fingerprint=fp, params=10**12, time=3.0),
               "t": IndexRecord(run_id="r", fingerprint="other", params=5, time=3.0)}
    live = {"a": progress(2, 1.0), "b": progress(2, 2.0), "s": progress(2**40, 0.0), "gone": progress(1, 100.0)}
    runs = {p: RunRecord(fingerprint=fp, time=1.0) for p in "ab"}
    commits = {"a": CommitRecord(name="a", round=2, sha256="", time=1.0)}
    row = describe_run("r", entries, live, commits, runs, {}, now)
    assert (row.round, row.live_peers, row.params, row.fingerprint, row.manifest) == (2, 3, 100, fp, "none")
    nobody = describe_run("r", entries, {"gone": progress(1, 100.0)}, commits, runs, {}, now)
    assert (nobody.round, nobody.live_peers) == (2, 0)  # no live peer: the round commit records name
    with_manifest = describe_run("swarm-tiny", entries, {}, {}, runs, {"a": _manifest(cfg)}, now)
    assert with_manifest.manifest == "ok" and with_manifest.round is None
    table = format_runs([row, dataclasses.replace(row, run_id="evil\x1b[2Jrun")])
    assert "\x1b" not in table and "100" in table and "evil?[2Jrun" in table


def _runs_row(cli, maddr: str, run_id: str) -> list[str]:
    result = cli("runs", "--initial-peers", maddr)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(run_id + " ")]
    return rows[0] if rows else []


@pytest.mark.timeout(150)
def test_a_peer_joins_by_run_name_and_ends_on_the_creators_parameters(tmp_path, cli, fork_server):
    """The joiner has no config file: it reads the run's manifest and trains the run with the creator."""
    hold = tmp_path / "hold"
    hold.touch()  # both wait before their first round until `swarm runs` saw them: the rounds are shared
    held = ["--faults.hold_round", "1", "--faults.hold_file", str(hold)]
    rounds = ["--diloco.rounds", "3", "--diloco.inner_steps", "4", "--swarm.target_group_size", "2",
              "--swarm.min_group_size", "2"]
    with local_swarm(tmp_path, fork_server) as swarm:
        maddr = swarm.start_bootstrap()
        creator = swarm.start_peer("creator", *rounds, *held)
        out = tmp_path / "joiner"
        joiner = spawn_child(fork_server, "joiner", ["join", "swarm-tiny", "--initial-peers", maddr, "--name", "joiner",
                                        "--out", str(out), "--diloco.threads", "1", "--logging.progress_bar", "false",
                                        "--swarm.bootstrap_timeout", "30", "--swarm.host_maddrs",
                                        "/ip4/127.0.0.1/tcp/0", *held], out / "log.txt", out)
        swarm.children.append(joiner)
        deadline = time.time() + 60
        while (row := _runs_row(cli, maddr, "swarm-tiny"))[2:3] != ["2"]:
            assert time.time() < deadline, f"swarm runs: {row}\n{swarm.log(joiner)[-3000:]}"
            assert joiner.proc.poll() is None, swarm.log(joiner)[-3000:]
            time.sleep(1.0)
        dry = cli("join", "swarm-tiny", "--initial-peers", maddr, "--dry-run", "--out", str(tmp_path / "dry"),
                  "--swarm.host_maddrs", "/ip4/127.0.0.1/tcp/0")  # reads the manifest, checks, trains nothing
        hold.unlink()
        swarm.wait([creator, joiner], timeout=90)
        for peer in (creator, joiner):
            assert peer.proc.returncode == 0, swarm.log(peer)[-3000:]
        summaries = [swarm.summary(p) for p in (creator, joiner)]
        configs = [json.loads((p.out_dir / "summary.json").read_text())["config"] for p in (creator, joiner)]
        log = swarm.log(joiner)  # one line per change of state

    cfg = config_from_dict(configs[0])
    assert dry.returncode == 0 and f"fingerprint: {run_identity(cfg).fingerprint} (the run's)" in dry.stdout, dry
    for line in ["joined run 'swarm-tiny'", "group formed with 2 peers", "round 3 committed", "left run 'swarm-tiny'"]:
        assert line in log, line
    # run, round (both held before round 1), live peers, parameters, fingerprint, manifest
    assert row == ["swarm-tiny", "0", "2", _count(count_parameters(build_model(cfg.model, 256))),
                   run_identity(cfg).fingerprint, "ok"]
    assert summaries[0]["rounds_completed"] == summaries[1]["rounds_completed"] == 3
    assert summaries[0]["final_global_sha256"] == summaries[1]["final_global_sha256"]
    assert summaries[1]["round_hashes"] == summaries[0]["round_hashes"]  # averaged together, round by round
    creator_cfg, joiner_cfg = (_shared_leaves(config_from_dict(c)) for c in configs)
    assert joiner_cfg == creator_cfg and joiner_cfg["model.hidden_size"] == 32  # SMALL's, not Config()'s 64


def _pieces_fetched(cache: Path) -> int:
    """How many pieces the fetch under `cache` noted so far (swarm/net/corpussync.py `have.json`)."""
    for noted in cache.glob("*.fetch/have.json"):
        with contextlib.suppress(OSError, ValueError):
            return len(json.loads(noted.read_text())["have"])
    return 0


@pytest.mark.timeout(240)
def test_a_joiner_on_a_bare_machine_fetches_the_corpus_from_the_run_and_goes_on_after_a_kill(tmp_path, fork_server):
    """Peer A prepares a corpus from text under one path and starts a run. B, as on another machine, has an empty
    data folder and an empty cache: `swarm join RUN --data.dataset <its empty data folder>` fetches A's token
    files (A sends at most 3 MB/s), is killed mid-fetch, runs the same command again, goes on from the pieces it
    had, and trains with A to the same final hash, on A's corpus (same content hash)."""
    text = tmp_path / "a" / "corpus"
    text.mkdir(parents=True)
    words = [f"w{i}" for i in range(500)]
    rng = random.Random(0)
    (text / "part.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(1000)) for _ in range(1600)))
    data = ["--data.source", "hf", "--data.dataset", str(text), "--data.max_documents", "1600"]
    hold = tmp_path / "hold"
    hold.touch()
    held = ["--faults.hold_round", "1", "--faults.hold_file", str(hold)]
    rounds = ["--diloco.rounds", "2", "--diloco.inner_steps", "3", "--swarm.target_group_size", "2",
              "--swarm.min_group_size", "2"]
    with local_swarm(tmp_path, fork_server) as swarm:
        maddr = swarm.start_bootstrap()
        creator = swarm.start_peer("creator", *rounds, *held, *data, "--data.cache_dir", str(tmp_path / "cache-a"),
                                   "--swarm.corpus_rate", "3e6")
        out, cache, empty = tmp_path / "joiner", tmp_path / "cache-b", tmp_path / "b" / "data"
        empty.mkdir(parents=True)
        argv = ["join", "swarm-tiny", "--initial-peers", maddr, "--name", "joiner", "--out", str(out),
                "--data.dataset", str(empty / "corpus"), "--data.cache_dir", str(cache), "--diloco.threads", "1",
                "--logging.progress_bar", "false",
                "--swarm.bootstrap_timeout", "30", "--swarm.host_maddrs", "/ip4/127.0.0.1/tcp/0", *held]
        first = spawn_child(fork_server, "joiner", argv, tmp_path / "first.log", tmp_path)
        swarm.children.append(first)
        wait_until(lambda: _pieces_fetched(cache) >= 1, 60, first, swarm, "first.log")
        os.killpg(first.proc.pid, signal.SIGKILL)  # killed mid-fetch
        first.proc.wait()
        had = _pieces_fetched(cache)
        again = spawn_child(fork_server, "joiner", argv, out / "log.txt", out)
        swarm.children.append(again)
        wait_until(lambda: "joined run 'swarm-tiny'" in swarm.log(again), 90, again, swarm)
        hold.unlink()
        swarm.wait([creator, again], timeout=120)
        for peer in (creator, again):
            assert peer.proc.returncode == 0, swarm.log(peer)[-3000:]
        summaries = [swarm.summary(p) for p in (creator, again)]
        log = swarm.log(again)

    assert 1 <= had < 4, had  # 4 MB pieces: ~13 MB of train and eval tokens
    assert f"going on with the {had} piece(s) fetched before" in log
    metas = [json.loads(next((tmp_path / c).glob("*/meta.json")).read_text()) for c in ("cache-a", "cache-b")]
    assert metas[0]["sha256"] == metas[1]["sha256"] and metas[1]["fetched_from"]
    assert summaries[0]["rounds_completed"] == summaries[1]["rounds_completed"] == 2
    assert summaries[0]["final_global_sha256"] == summaries[1]["final_global_sha256"]


def wait_until(done, timeout: float, child, swarm, log: str = "log.txt") -> None:
    deadline = time.time() + timeout
    while not done():
        assert time.time() < deadline and child.proc.poll() is None, (child.out_dir / log).read_text()[-3000:]
        time.sleep(0.2)
