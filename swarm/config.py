"""Typed configuration: one dataclass per concern, composed under `Config`.

A config is loaded from a YAML file (`configs/*.yaml`) and then overridden with dotted keys from the
command line (`--inner.lr 3e-4` or `inner.lr=3e-4`). Unknown keys, wrong types and broken cross-field
rules raise `ConfigError` with a one-line message that names the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A bad config: the message is one line and names the culprit key or file."""


@dataclass
class ModelConfig:
    """The causal LM: built from these shapes (seeded random init) or loaded from `pretrained`."""

    pretrained: Optional[str] = None  # local path or hub name for `from_pretrained`; shapes below are then ignored
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: Optional[int] = None  # None: same as num_heads (no grouped-query attention)
    intermediate_size: int = 172
    max_seq_len: int = 256
    vocab_size: Optional[int] = None  # None: taken from the tokenizer
    seed: int = 0  # random init seed: every peer of a run must build the same initial weights


@dataclass
class DataConfig:
    """Where tokens come from and how each peer's shard is cut."""

    source: Literal["embedded", "hf"] = "embedded"  # embedded: Python's standard library source, no download
    dataset: Optional[str] = None  # source=hf: hub name or local path (folder or .txt/.json/.jsonl/.parquet file)
    dataset_config: Optional[str] = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = True
    tokenizer: str = "bytes"  # "bytes" (256 symbols, no download) or a tokenizer name/path for AutoTokenizer
    seq_len: int = 128
    batch_size: int = 8
    num_shards: int = 64  # the training stream is cut into this many disjoint shards
    shard: Optional[int] = None  # this peer's shard; None: derived from (run, peer name, seed)
    eval_fraction: float = 0.05  # share of documents held out for eval; no shard ever trains on them
    eval_batches: int = 8
    max_documents: Optional[int] = None  # cap on documents read (embedded corpus / hf), None: all
    seed: int = 0


@dataclass
class InnerConfig:
    """The local AdamW optimizer each peer runs for H inner steps per round."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last inner step
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    """adamw8bit: bitsandbytes' AdamW8bit, moments in 8 bits (blockwise): 2 bytes per parameter of optimizer
    state instead of 8."""
    micro_batch_size: Optional[int] = None
    """Sequences per forward/backward pass: an inner step accumulates gradients over data.batch_size /
    micro_batch_size passes, the same step as one pass over the whole batch up to float rounding. None: the
    whole batch in one pass. Lower it if an inner step runs out of device memory."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: forward and backward (and eval) under bf16 autocast; the parameters, gradients, AdamW moments,
    global parameters and outer momentum stay fp32, so no update is lost to bf16 rounding."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass: less memory for ~30% more compute."""


@dataclass
class OuterConfig:
    """The outer optimizer: SGD with Nesterov momentum on the global parameters."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass
class DilocoConfig:
    """The two-level loop: `rounds` outer steps of `inner_steps` (H) inner steps each."""

    rounds: int = 6
    inner_steps: int = 50
    eval_every: int = 1  # rounds between held-out evals
    device: str = "cpu"
    global_device: str = "cpu"  # where the fp32 global parameters and outer momentum live
    threads: int = 0  # torch intra-op threads for this peer; 0 leaves torch's default
    # Inner steps by which a round's outer step trails its end (swarm/overlap.py): 0 stops computing while the
    # peers average; tau >= 1 averages round r behind the first tau inner steps of round r+1 and applies the
    # result after them, waiting there if it has not arrived. Pick tau so that tau inner steps outlast a round's
    # matchmaking and all-reduce.
    delay: int = 0
    fragments: int = 1
    """Streaming DiLoCo (swarm/fragments.py): F contiguous fragments of the parameter tensors, fragment f exchanged
    after inner step (f + 1) * inner_steps // F of each round: F exchanges of ~1/F of the bytes per round."""
    mix_alpha: float = 0.0
    """Where an exchange lands, local <- alpha * local + (1 - alpha) * (new global + the inner steps taken since
    it started): 0 takes the group's outer step fully (plain DiLoCo), 1 keeps the peer's own stand-in."""


@dataclass
class SwarmConfig:
    """The network: DHT bootstrap, matchmaking and all-reduce. Every time-out is finite."""

    run_id: str = "swarm-tiny"  # DHT key prefix; several runs can share one DHT
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: Optional[str] = None
    client_mode: bool = False
    target_group_size: int = 64  # a group forms at once when this many peers are ready
    min_group_size: int = 2
    compression: Literal["none", "fp16", "int8", "int4"] = "none"
    """How pseudo-gradients travel in the all-reduce (reduction is always fp32): none (fp32), fp16, int8
    (blockwise, ~0.27x the bytes of none), int4 (blockwise, ~0.16x). Tensors under 8192 elements always
    travel in fp32. Wire formats and measured errors: swarm/net/codec.py."""
    error_feedback: bool = False
    """With a lossy compression: add what quantization dropped from this peer's pseudo-gradient in one round
    to its next one (per peer, kept in its checkpoint)."""
    bootstrap_timeout: float = 30.0
    """Give up joining after this long: raise it if "initial peers unreachable" appears on a slow link."""
    matchmaking_time: float = 5.0
    """How long a leader waits for groupmates: raise it if peers of one round end up in separate groups."""
    request_timeout: float = 3.0
    """Per-request wait in matchmaking; must stay below matchmaking_time or leaders deadlock."""
    stall_timeout: float = 30.0
    """A stream (all-reduce, state download) that moves no byte for this long is given up: a peer killed
    mid-round makes the survivors retry after this, not hang. Raise it if "stalled" shows up on links that
    are slow but alive."""
    min_bandwidth: float = 1e6
    """Bytes/s: the slowest link the swarm supports. A transfer of B bytes is given up after stall_timeout +
    B / min_bandwidth s, and a round after three such all-reduces plus matchmaking (swarm/net/budget.py).
    Lower it if a slow but steady peer logs "not done within"."""
    progress_interval: float = 1.0
    """Seconds between progress records (and checks whether peers wait to average): lower it if stragglers
    join a round's group too late; raise it if the DHT traffic of many peers is too much."""
    progress_expiration: float = 60.0
    """A progress record older than this marks its peer as gone: lower it if dead peers are waited on."""
    linger_time: float = 60.0
    """After its last round a peer keeps serving its state this long at most, while live peers are still at
    earlier rounds: raise it if a peer that fell behind near the end logs "state from ... refused" and
    ends on its own stale parameters."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None: <out>/checkpoint
    every: int = 1  # rounds between checkpoints; 0 disables
    resume: bool = True  # resume from dir if a checkpoint is there


@dataclass
class LoggingConfig:
    progress_bar: bool = True
    dump_tensors: bool = False  # write each round's pseudo-gradient, weight and new global params to <out>/tensors


@dataclass
class FaultsConfig:
    """Fault injection for tests and demos (`swarm local --kill/--join`), applied by the peer to itself."""

    kill_round: Optional[int] = None  # die while working towards this round (1-based outer step)
    kill_phase: Literal["inner", "allreduce"] = "inner"  # mid inner steps, or inside the all-reduce
    step_delay: float = 0.0  # extra seconds per inner step: a slow peer (straggler)
    nan_round: Optional[int] = None  # this peer's local model turns NaN halfway through this round (1-based)
    kill_rank: Optional[int] = None  # a multi-process peer: only this rank kills itself (None: every rank)
    # While `hold_file` exists, wait before working towards round `hold_round` (0: before joining the swarm at
    # all, publishing nothing). A test or `swarm local --join` starts the peer early and lets it go on cue, so
    # that a process start-up (seconds, more on a loaded machine) never races the swarm's rounds.
    hold_round: Optional[int] = None
    hold_file: str = ""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of what peers must share to average together: model shapes, tokenizer, outer rule, H."""
        shared = {
            "model": self.model.__dict__,
            "tokenizer": self.data.tokenizer,
            "seq_len": self.data.seq_len,
            "outer": self.outer.__dict__,
            "inner_steps": self.diloco.inner_steps,
            "compression": self.swarm.compression,
        }
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def live_window(s: SwarmConfig) -> float:
    """A peer whose progress record was not refreshed for this long is gone: its heartbeat re-stores it every
    `progress_interval`, and one store may take up to `request_timeout`."""
    return 5 * s.progress_interval + 2 * s.request_timeout


_BYTES = "swarm.stall_timeout and swarm.min_bandwidth (time-outs now follow the bytes)"
RETIRED = {"swarm.allreduce_timeout": _BYTES, "swarm.round_timeout": _BYTES, "swarm.state_timeout": _BYTES,
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
        _deep_merge(merged, _nest(key, parsed[0] if len(parsed) == 1 else parsed))
    return merged


def _deep_merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = v


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
                       ("data.batch_size", d.batch_size), ("data.seq_len", d.seq_len)]:
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    micro = cfg.inner.micro_batch_size
    if micro is not None and (micro < 1 or d.batch_size % micro):
        raise ConfigError(f"inner.micro_batch_size {micro} does not divide data.batch_size {d.batch_size}")
    if cfg.inner.warmup_steps > cfg.diloco.rounds * cfg.diloco.inner_steps:
        raise ConfigError("inner.warmup_steps exceeds the total inner steps (diloco.rounds * diloco.inner_steps)")
    if not 0.0 <= cfg.outer.momentum < 1.0:
        raise ConfigError(f"outer.momentum {cfg.outer.momentum} must be in [0, 1)")
    if s.request_timeout >= s.matchmaking_time:
        raise ConfigError("swarm.request_timeout must be below swarm.matchmaking_time")
    if s.min_group_size < 1 or s.target_group_size < s.min_group_size:
        raise ConfigError("swarm.target_group_size must be >= swarm.min_group_size >= 1")
    for name in ("bootstrap_timeout", "matchmaking_time", "stall_timeout", "progress_interval"):
        if not getattr(s, name) > 0:
            raise ConfigError(f"swarm.{name} must be a positive number of seconds")
    if not s.min_bandwidth > 0:
        raise ConfigError(f"swarm.min_bandwidth must be a positive number of bytes/s, got {s.min_bandwidth}")
    dl = cfg.diloco
    if not 1 <= dl.fragments <= dl.inner_steps:
        raise ConfigError(f"diloco.fragments {dl.fragments} must be in [1, diloco.inner_steps = {dl.inner_steps}]")
    if not 0 <= dl.delay < dl.inner_steps // dl.fragments:
        raise ConfigError(f"diloco.delay {dl.delay} must be in [0, diloco.inner_steps // diloco.fragments = "
                          f"{dl.inner_steps // dl.fragments}): an exchange lands before the next one starts")
    if not 0.0 <= dl.mix_alpha <= 1.0:
        raise ConfigError(f"diloco.mix_alpha {dl.mix_alpha} must be in [0, 1]")
    if dl.fragments > 1 and cfg.logging.dump_tensors:
        raise ConfigError("logging.dump_tensors records whole rounds: it needs diloco.fragments 1")
    f = cfg.faults
    if (f.hold_round is None) != (not f.hold_file) or (f.hold_round is not None and f.hold_round < 0):
        raise ConfigError("faults.hold_round (a round >= 0) and faults.hold_file go together")
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
    validate(cfg)
    return cfg


def config_from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (checkpoints and summaries carry it)."""
    return load_config(None, values)
