"""One run identity (swarm/run/runid.py): every key of the run config, the corpus and the initial weights are in the
fingerprint, no per-peer key is, and a refusal names the first part that differs."""

import copy

import pytest

from swarm.config import CORPUS_LOCATION_KEYS, shared_config
from swarm.errors import UsageError
from swarm.run.runid import RunIdentity, run_identity, weights_sha256
from tests.conftest import tiny_config


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, "x"]
    return 1  # None


def test_every_run_key_is_in_the_fingerprint_and_a_difference_names_it():
    run = RunIdentity(shared_config(tiny_config()), "c0ffee")
    keys = [(section, key) for section, values in run.config.items() for key in values]
    assert ("diloco", "fragments") in keys and ("inner", "precision") in keys and ("data", "seq_len") in keys
    assert ("swarm", "progress_expiration") in keys and ("diloco", "delay") in keys  # who counts as live: the run's
    for section, key in keys:
        other = copy.deepcopy(run.config)
        other[section][key] = _changed(other[section][key])
        theirs = RunIdentity(other, "c0ffee")
        if f"{section}.{key}" in CORPUS_LOCATION_KEYS:  # where the corpus lies: its content is the run's instead
            assert theirs.fingerprint == run.fingerprint and theirs.first_difference(run) is None, f"{section}.{key}"
            continue
        assert theirs.fingerprint != run.fingerprint, f"{section}.{key}"
        assert theirs.first_difference(run).startswith(f"{section}.{key} is "), f"{section}.{key}"
    fragments = RunIdentity(shared_config(tiny_config(diloco={"fragments": 2})), "c0ffee")
    assert fragments.first_difference(run) == "diloco.fragments is 2 here but 1 in the run"
    assert run.first_difference(run) is None


def test_per_peer_keys_are_not_the_run_s():
    mine = tiny_config()
    theirs = tiny_config(diloco={"device": "cuda", "threads": 8}, inner={"micro_batch_size": 2},
                         data={"shard": 5}, checkpoint={"every": 3}, logging={"tensorboard": True},
                         swarm={"client_mode": True, "bootstrap_timeout": 90.0, "host_maddrs": ["/ip4/0.0.0.0/tcp/5"]})
    assert RunIdentity(shared_config(mine), "c").fingerprint == RunIdentity(shared_config(theirs), "c").fingerprint


def test_the_corpus_and_the_initial_weights_are_part_of_the_run(tmp_path):
    cfg = tiny_config()
    run = run_identity(cfg)
    assert run.corpus_sha256 and run.weights_sha256 is None
    other = RunIdentity(run.config, "beef")
    assert other.fingerprint != run.fingerprint and other.first_difference(run).startswith("the prepared corpus")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text('{"model_type": "llama"}')
    first = weights_sha256(str(model))
    (model / "config.json").write_text('{"model_type": "llama", "transformers_version": "9"}')  # who wrote it
    assert weights_sha256(str(model)) == first
    (model / "model.safetensors").write_bytes(b"other weights")
    assert weights_sha256(str(model)) != first
    with pytest.raises(UsageError, match="model.pretrained org/name: no such folder"):  # nothing downloads
        weights_sha256("org/name")
    tuned = RunIdentity(run.config, run.corpus_sha256, first)
    assert tuned.first_difference(run).startswith("model.pretrained's weights differ")


@pytest.mark.parametrize("fragments, steps, delay", [(1, 40, 4), (1, 9, 0), (2, 40, 2), (4, 500, 12)])
def test_delay_auto_resolves_before_the_fingerprint(fragments, steps, delay):
    cfg = tiny_config(diloco={"fragments": fragments, "inner_steps": steps, "delay": "auto"})
    assert cfg.diloco.delay == delay and shared_config(cfg)["diloco"]["delay"] == delay


@pytest.mark.timeout(120)
def test_a_copy_of_the_corpus_anywhere_is_the_run_s_and_another_corpus_is_refused_with_both_hashes(tmp_path):
    """The run names its corpus by content: a peer whose copy lies at another path (another machine's folder) is
    the same run; a copy that differs (its first line changed) is refused, naming both hashes."""
    lines = [f"line {i}: the quick brown fox jumps over {i % 7} lazy dogs" for i in range(200)]
    for where, text in [("a/corpus", lines), ("b/elsewhere/mine", lines), ("c/corpus", ["changed", *lines[1:]])]:
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "part.txt").write_text("\n".join(text) + "\n")

    def identity(where: str) -> RunIdentity:
        return run_identity(tiny_config(data={"source": "hf", "dataset": str(tmp_path / where),
                                              "cache_dir": str(tmp_path / "cache")}))

    run, copy_, other = identity("a/corpus"), identity("b/elsewhere/mine"), identity("c/corpus")
    assert copy_.corpus_sha256 == run.corpus_sha256 and copy_.fingerprint == run.fingerprint
    assert copy_.first_difference(run) is None
    assert other.fingerprint != run.fingerprint
    assert other.first_difference(run) == (f"the prepared corpus differs (sha256 {other.corpus_sha256[:16]} here, "
                                           f"{run.corpus_sha256[:16]} in the run: another dataset, tokenizer or "
                                           f"version of it)")
