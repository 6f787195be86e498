"""Loading a `Config` (swarm/config.py): a YAML file (`configs/*.yaml`), then dotted overrides from the command
line (`--inner.lr 3e-4` or `inner.lr=3e-4`); wrong types, unknown and retired keys and broken cross-field
rules raise `ConfigError` with a one-line message that names the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from swarm.config import ATTACKS, MAX_IDENTITY_WORK, Config, ConfigError, live_window

_BYTES = "swarm.stall_timeout and swarm.min_bandwidth (time-outs now follow the bytes)"
RETIRED = {"swarm.allreduce_timeout": _BYTES, "swarm.round_timeout": _BYTES, "swarm.state_timeout": _BYTES,
           "swarm.identity_path": "swarm.identity",
           "model.dtype": "inner.precision (parameters and optimizer state are always fp32; bf16 is autocast)"}
"""Keys that existed once: a config still using one is told what replaced it."""


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return `value` coerced to `tp` (int -> float only), or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(key, value, arg)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_check_type(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    return value


def _apply(section: Any, prefix: str, values: dict[str, Any]) -> None:
    hints = typing.get_type_hints(type(section))
    names = {f.name for f in dataclasses.fields(section)}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in names:
            while isinstance(value, dict) and len(value) == 1:  # name the full dotted key of an override
                (sub, value), = value.items()
                key = f"{key}.{sub}"
            if key in RETIRED:
                raise ConfigError(f"config key {key!r} was replaced by {RETIRED[key]}")
            raise ConfigError(f"unknown config key {key!r}")
        current = getattr(section, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping, got {value!r}")
            _apply(current, f"{key}.", value)
        else:
            setattr(section, name, _check_type(key, value, hints[name]))


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {head: _nest(rest, value) if rest else value}


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `["--inner.lr", "3e-4", "outer.lr=0.5", "--swarm.initial_peers", "a", "b"]` into nested dicts.

    Values are parsed as YAML scalars; a key followed by several values becomes a list.
    """
    merged: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if "=" in arg and not arg.startswith("--"):
            key, raw = arg.split("=", 1)
            values = [raw]
            i += 1
        elif arg.startswith("--"):
            key, _, inline = arg[2:].partition("=")
            values = [inline] if inline else []
            i += 1
            while not inline and i < len(args) and not args[i].startswith("--") and "=" not in args[i]:
                values.append(args[i])
                i += 1
            if not values:
                raise ConfigError(f"override --{key} has no value")
        else:
            raise ConfigError(f"cannot read override {arg!r}: use --section.key VALUE or section.key=VALUE")
        if "." not in key:
            raise ConfigError(f"unknown config key {key!r}: overrides look like section.key")
        parsed = [yaml.safe_load(v) if v != "" else None for v in values]
        deep_merge(merged, _nest(key, parsed[0] if len(parsed) == 1 else parsed))
    return merged


def deep_merge(into: dict, other: dict) -> dict:
    """`other`'s keys into `into`, section by section (a nested dict merges, anything else replaces); `into`."""
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            deep_merge(into[k], v)
        else:
            into[k] = v
    return into


def resolve(cfg: Config) -> None:
    """Values that follow other keys, once every override is in: `diloco.delay: auto`."""
    dl = cfg.diloco
    if dl.delay == "auto":
        dl.delay = max(1, dl.inner_steps // max(1, dl.fragments)) // 10  # a bad fragments is refused below


def validate(cfg: Config) -> None:
    """Cross-field rules that a single type cannot express."""
    m, d, s = cfg.model, cfg.data, cfg.swarm
    if m.pretrained is None and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size {m.hidden_size} is not divisible by model.num_heads {m.num_heads}")
    if m.num_kv_heads is not None and m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads {m.num_heads} is not divisible by model.num_kv_heads {m.num_kv_heads}")
    if d.seq_len > m.max_seq_len and m.pretrained is None:
        raise ConfigError(f"data.seq_len {d.seq_len} exceeds model.max_seq_len {m.max_seq_len}")
    if d.shard is not None and not 0 <= d.shard < d.num_shards:
        raise ConfigError(f"data.shard {d.shard} is outside [0, data.num_shards={d.num_shards})")
    if d.source == "hf" and not d.dataset:
        raise ConfigError("data.dataset is required when data.source is 'hf'")
    if not 0.0 < d.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction {d.eval_fraction} must be in (0, 1)")
    for key, value in [("diloco.rounds", cfg.diloco.rounds), ("diloco.inner_steps", cfg.diloco.inner_steps),
                       ("data.batch_size", d.batch_size), ("data.seq_len", d.seq_len),
                       ("data.prepare_workers", 1 if d.prepare_workers is None else d.prepare_workers)]:
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if cfg.checkpoint.keep < 1 or cfg.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.keep {cfg.checkpoint.keep} must be >= 1 and checkpoint.every "
                          f"{cfg.checkpoint.every} >= 0 (0: no checkpoints)")
    micro = cfg.inner.micro_batch_size
    if micro is not None and (micro < 1 or d.batch_size % micro):
        raise ConfigError(f"inner.micro_batch_size {micro} does not divide data.batch_size {d.batch_size}")
    if cfg.inner.parallel == "fsdp" and cfg.inner.optimizer == "adamw8bit":
        raise ConfigError("inner.optimizer adamw8bit cannot step the sharded parameters of inner.parallel fsdp: "
                          "use inner.optimizer adamw")
    if cfg.inner.warmup_steps > (total := cfg.diloco.rounds * cfg.diloco.inner_steps):
        raise ConfigError(f"inner.warmup_steps {cfg.inner.warmup_steps} exceeds the run's {total} inner steps "
                          f"(diloco.rounds {cfg.diloco.rounds} * diloco.inner_steps {cfg.diloco.inner_steps}): pass "
                          f"--inner.warmup_steps {max(1, total // 10)} (a tenth of them) or at most {total}")
    if not 0.0 <= cfg.outer.momentum < 1.0:
        raise ConfigError(f"outer.momentum {cfg.outer.momentum} must be in [0, 1)")
    if s.request_timeout >= s.matchmaking_time:
        raise ConfigError("swarm.request_timeout must be below swarm.matchmaking_time")
    if s.min_group_size < 1 or s.target_group_size < s.min_group_size:
        raise ConfigError("swarm.target_group_size must be >= swarm.min_group_size >= 1")
    for name in ("bootstrap_timeout", "matchmaking_time", "stall_timeout", "progress_interval"):
        if not getattr(s, name) > 0:
            raise ConfigError(f"swarm.{name} must be a positive number of seconds")
    if not 0 <= s.data_port < 65536:
        raise ConfigError(f"swarm.data_port {s.data_port} is not a TCP port (0: any free port)")
    if (s.auth == "allowlist") != bool(s.allowed_peers):
        raise ConfigError("swarm.allowed_peers (peer ids) and swarm.auth: allowlist go together")
    for peer in s.allowed_peers:
        if not re.fullmatch(r"(Qm|12D3Koo)[1-9A-HJ-NP-Za-km-z]{40,50}", peer):
            raise ConfigError(f"swarm.allowed_peers: {peer!r} is not a peer id (base58, Qm... or 12D3Koo...)")
    if not s.corpus_rate >= s.min_bandwidth:
        raise ConfigError(f"swarm.corpus_rate {s.corpus_rate:g} must be at least swarm.min_bandwidth "
                          f"{s.min_bandwidth:g} bytes/s: a peer fetching the corpus gives up on a slower one")
    if not s.min_bandwidth > 0:
        raise ConfigError(f"swarm.min_bandwidth must be a positive number of bytes/s, got {s.min_bandwidth}")
    dl = cfg.diloco
    if not 1 <= dl.fragments <= dl.inner_steps:
        raise ConfigError(f"diloco.fragments {dl.fragments} must be in [1, diloco.inner_steps = {dl.inner_steps}]")
    if not 0 <= dl.delay < dl.inner_steps // dl.fragments:
        raise ConfigError(f"diloco.delay {dl.delay} must be in [0, diloco.inner_steps // diloco.fragments = "
                          f"{dl.inner_steps // dl.fragments}): an exchange lands before the next one starts; pass "
                          f"--diloco.delay auto ({max(1, dl.inner_steps // dl.fragments) // 10} here), at most "
                          f"{max(0, dl.inner_steps // dl.fragments - 1)}, or 0 (blocking rounds)")
    if not 0.0 <= dl.mix_alpha <= 1.0:
        raise ConfigError(f"diloco.mix_alpha {dl.mix_alpha} must be in [0, 1]")
    if dl.fragments > 1 and cfg.logging.dump_tensors:
        raise ConfigError("logging.dump_tensors records whole rounds: it needs diloco.fragments 1")
    f = cfg.faults
    if (f.hold_round is None) != (not f.hold_file) or (f.hold_round is not None and f.hold_round < 0):
        raise ConfigError("faults.hold_round (a round >= 0) and faults.hold_file go together")
    for kind in f.hostile:
        if kind not in ATTACKS:
            raise ConfigError(f"faults.hostile: unknown attack {kind!r} (known: {', '.join(ATTACKS)})")
    if not (type(s.identity_work) is int and 0 <= s.identity_work <= MAX_IDENTITY_WORK):
        raise ConfigError(f"swarm.identity_work {s.identity_work!r} must be an integer in [0, {MAX_IDENTITY_WORK}] "
                          f"(bits of proof of work; {MAX_IDENTITY_WORK} takes under a minute to find on one core)")
    if not 0.0 < s.max_weight_share <= 1.0:
        raise ConfigError(f"swarm.max_weight_share {s.max_weight_share} must be in (0, 1] (1 is off)")
    if not (s.clip_norm_ratio == 0.0 or 1.0 <= s.clip_norm_ratio < math.inf):
        raise ConfigError(f"swarm.clip_norm_ratio {s.clip_norm_ratio} must be 0 (off) or a finite number >= 1 "
                          f"(below 1 it shrinks the median member too)")
    if s.progress_expiration <= live_window(s):
        raise ConfigError(f"swarm.progress_expiration {s.progress_expiration:g} must exceed the {live_window(s):g} s "
                          f"after which a silent peer counts as gone (5 x progress_interval + 2 x request_timeout)")


def load_config(path: str | Path | None, overrides: list[str] | dict | None = None) -> Config:
    """Load `path` (YAML), apply overrides (CLI strings or a nested dict), validate, return the Config."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        _apply(cfg, "", raw)
    if overrides:
        _apply(cfg, "", parse_overrides(overrides) if isinstance(overrides, list) else overrides)
    resolve(cfg)
    validate(cfg)
    return cfg


def config_from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (checkpoints and summaries carry it)."""
    return load_config(None, values)
