import re
from pathlib import Path

import pytest

from swarm.config import ConfigError, shared_config
from swarm.run.configfile import load_config, parse_overrides
from swarm.run.runid import RunIdentity
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.timeout(60)

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_configs_folder_is_not_empty():
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "llama-150m.yaml", "llama-1b.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path):
    cfg = load_config(path)
    assert cfg.diloco.rounds >= 1 and cfg.outer.lr > 0


def test_paper_150m_recipe():
    cfg = load_config(ROOT / "configs" / "llama-150m.yaml")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_heads) == (12, 896, 16)
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.diloco.inner_steps) == (1024, 512, 500)
    assert (cfg.inner.lr, cfg.inner.warmup_steps, cfg.inner.weight_decay) == (4e-4, 1000, 0.1)
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == (0.7, 0.9, True)


def test_overrides_in_both_forms():
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["--inner.lr", "3e-4", "outer.lr=0.5",
                                                       "--swarm.initial_peers", "/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"])
    assert cfg.inner.lr == 3e-4 and cfg.outer.lr == 0.5
    assert cfg.swarm.initial_peers == ["/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2"]
    assert parse_overrides(["--diloco.rounds=3"]) == {"diloco": {"rounds": 3}}


@pytest.mark.parametrize("overrides, culprit", [
    (["--bogus.key", "1"], "bogus.key"),
    (["--inner.nope", "1"], "inner.nope"),
    (["--inner.lr", "fast"], "inner.lr"),
    (["--diloco.rounds", "2.5"], "diloco.rounds"),
    (["--swarm.compression", "int3"], "swarm.compression"),
    (["--model.hidden_size", "130"], "model.hidden_size"),
    (["--swarm.request_timeout", "9"], "swarm.request_timeout"),
    (["--swarm.min_bandwidth", "0"], "swarm.min_bandwidth"),
    (["--swarm.corpus_rate", "5e5"], "swarm.corpus_rate 500000 must be at least swarm.min_bandwidth 1e+06 bytes/s"),
    (["--swarm.stall_timeout", "-1"], "swarm.stall_timeout"),
    (["--swarm.progress_expiration", "5"], "swarm.progress_expiration"),
    (["--faults.hold_round", "2"], "faults.hold_round"),
    (["--diloco.delay", "40"], "diloco.delay"),
    (["--diloco.delay", "-1"], "diloco.delay"),
    (["--diloco.fragments", "0"], "diloco.fragments"),
    (["--diloco.fragments", "41"], "diloco.fragments 41 must be in [1, diloco.inner_steps = 40]"),
    (["--diloco.fragments", "2", "--diloco.delay", "20"], "diloco.delay 20 must be in [0, diloco.inner_steps // "),
    (["--diloco.inner_steps", "4", "--diloco.delay", "4"],
     "diloco.delay 4 must be in [0, diloco.inner_steps // diloco.fragments = 4): an exchange lands before the next "
     "one starts; pass --diloco.delay auto (0 here), at most 3, or 0 (blocking rounds)"),
    (["--diloco.inner_steps", "3"], "inner.warmup_steps 20 exceeds the run's 18 inner steps (diloco.rounds 6 * "
     "diloco.inner_steps 3): pass --inner.warmup_steps 1 (a tenth of them) or at most 18"),
    (["--diloco.delay", "soon"], "diloco.delay"),
    (["--diloco.fragments", "2.5"], "diloco.fragments"),
    (["--diloco.mix_alpha", "1.5"], "diloco.mix_alpha"),
    (["--diloco.mix_alpha", "-0.1"], "diloco.mix_alpha"),
    (["--diloco.fragments", "2", "--logging.dump_tensors", "true"], "logging.dump_tensors"),
    (["--faults.hold_file", "x"], "faults.hold_round"),
    (["--faults.hostile", "sneaky"], "faults.hostile: unknown attack 'sneaky'"),
    (["--swarm.auth", "allowlist"], "swarm.allowed_peers"),
    (["--swarm.auth", "allowlist", "--swarm.allowed_peers", "alice"], "swarm.allowed_peers: 'alice' is not a peer id"),
    (["--swarm.allowed_peers", "QmaN6eWoit9vsGKnZdDbsEXTfXcBFT5e6VWhv3FTukYcCL"], "swarm.allowed_peers"),
    (["--swarm.auth", "closed"], "swarm.auth"),
    (["--swarm.identity_path", "k"], "swarm.identity_path' was replaced by swarm.identity"),
    (["--swarm.identity_work", "-1"], "swarm.identity_work -1 must be an integer in [0, 27]"),
    (["--swarm.identity_work", "28"], "swarm.identity_work 28 must be an integer in [0, 27]"),
    (["--swarm.identity_work", "1.5"], "swarm.identity_work"),
    (["--swarm.max_weight_share", "0"], "swarm.max_weight_share"),
    (["--swarm.max_weight_share", "1.5"], "swarm.max_weight_share"),
    (["--swarm.clip_norm_ratio", "0.5"], "swarm.clip_norm_ratio"),
    (["--swarm.clip_norm_ratio", "-1"], "swarm.clip_norm_ratio"),
    (["--swarm.clip_norm_ratio", ".inf"], "swarm.clip_norm_ratio"),
    (["--swarm.aggregation", "median"], "swarm.aggregation"),
    (["--swarm.verify_parts", "2"], "swarm.verify_parts"),
    (["--swarm.client_mode", "maybe"], "swarm.client_mode"),
    (["--swarm.data_port", "70000"], "swarm.data_port 70000 is not a TCP port"),
    (["--swarm.data_plane", "tcp"], "swarm.data_plane"),
    (["--swarm.allreduce_timeout", "60"], "swarm.allreduce_timeout' was replaced by swarm.stall_timeout"),
])
def test_bad_overrides_name_the_culprit(overrides, culprit):
    with pytest.raises(ConfigError, match=re.escape(culprit)):
        load_config(ROOT / "configs" / "tiny.yaml", overrides)


@pytest.mark.parametrize("config, overrides, delay", [
    ("tiny.yaml", [], 4), ("tiny.yaml", ["--diloco.inner_steps", "4"], 0), ("tiny.yaml", ["--diloco.inner_steps", "2", "--inner.warmup_steps", "2"], 0),
    ("tiny.yaml", ["--diloco.inner_steps", "400"], 40), ("tiny.yaml", ["--diloco.fragments", "2"], 2),
    ("tiny.yaml", ["--diloco.delay", "7"], 7), ("llama-150m.yaml", [], 50),
    ("llama-150m.yaml", ["--diloco.inner_steps", "30", "--inner.warmup_steps", "10"], 3),
])
def test_delay_auto_is_a_tenth_of_the_steps_between_exchanges(config, overrides, delay):
    """The shipped configs say `delay: auto`: changing H or F never makes them invalid."""
    assert load_config(ROOT / "configs" / config, overrides).diloco.delay == delay


def test_the_robust_rule_is_in_the_fingerprint_and_bounds_influence_by_default():
    """Peers that reduce by other rules must not meet; the defaults bound one peer's influence (an open swarm
    relaxing them is warned: `relaxed`), and setting a default explicitly changes nothing."""
    def fingerprint(cfg) -> str:
        return RunIdentity(shared_config(cfg), "").fingerprint
    default = load_config(ROOT / "configs" / "tiny.yaml")
    s = default.swarm
    assert (s.max_weight_share, s.clip_norm_ratio, s.aggregation, s.verify_parts) == (0.5, 4.0, "trimmed_mean", True)
    assert s.relaxed() == []
    explicit = load_config(ROOT / "configs" / "tiny.yaml", ["--swarm.aggregation", "trimmed_mean"])
    assert fingerprint(explicit) == fingerprint(default)
    plain = load_config(ROOT / "configs" / "tiny.yaml", ["--swarm.aggregation", "mean", "--swarm.max_weight_share", "1",
                                                         "--swarm.clip_norm_ratio", "0", "--swarm.verify_parts", "false"])
    assert fingerprint(plain) != fingerprint(default)
    assert plain.swarm.relaxed() == ["max_weight_share 1", "clip_norm_ratio 0", "aggregation mean",
                                     "verify_parts false"]


def test_unknown_key_in_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("inner:\n  lr: 0.1\n  learning_rate: 0.2\n")
    with pytest.raises(ConfigError, match="inner.learning_rate"):
        load_config(bad)


def test_cli_bogus_key_exits_2_naming_it():
    result = run_cli("peer", "--config", "configs/tiny.yaml", "--solo", "--bogus.key", "1")
    assert result.returncode == 2
    assert "bogus.key" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_missing_config_exits_2():
    result = run_cli("peer", "--config", "configs/nope.yaml", "--solo")
    assert result.returncode == 2 and "configs/nope.yaml" in result.stderr
