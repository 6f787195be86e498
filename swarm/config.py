"""Typed configuration: one dataclass per concern, composed under `Config`. Loaded (a YAML file, dotted
command-line overrides, every key and type checked, cross-field rules) by swarm/configfile.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional


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
    # matchmaking and all-reduce. The shipped configs set a tenth of H (README); a config that says nothing blocks.
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
    identity: Optional[str] = None
    """This peer's key file (created if missing): its peer id and the signature on its DHT records
    (swarm/net/identity.py). None: a fresh key, and peer id, for every start."""
    auth: Literal["open", "allowlist"] = "open"
    """open: anyone may join. allowlist: only `allowed_peers` may write this run's DHT records, meet in
    groups, send to the all-reduce or download the state (a private swarm)."""
    allowed_peers: list[str] = field(default_factory=list)  # base58 peer ids (`swarm.auth: allowlist`)
    client_mode: bool = False
    """True for a peer that cannot be dialed (behind a NAT or a firewall; `swarm peer --client-mode`): it only
    dials out, averages with the swarm but owns no part of the all-reduce, never leads a group and never serves
    its state. Every group needs at least one peer that is not a client. No libp2p relay is involved: a client
    needs none to dial out, and a relayed (circuit v2) connection is capped far below a round's bytes."""
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
    # Bounded influence (swarm/net/robust.py, audit.py): off by default, see there why.
    max_weight_share: float = 1.0
    """In (0, 1], 1 = off: cap on one member's share of its group's weight (water-filling; equal shares if
    fewer than 1/cap members have samples). Lower it if a peer claiming huge sample counts dictates."""
    clip_norm_ratio: float = 0.0
    """0 = off, or >= 1: each member's chunk is scaled down to this x the median of the members' norms of
    that chunk (per chunk: an owner never holds a whole part). Set it if a huge pseudo-gradient dictates."""
    aggregation: Literal["mean", "trimmed_mean", "centered_clip"] = "mean"
    """A part owner's per-chunk reducer: weighted mean, coordinate-wise trimmed mean, or centered clip."""
    verify_parts: bool = False
    """Each member recomputes one random chunk of every other part and fails the round on a lying owner."""

    def robust_rule(self) -> tuple:
        """What every member of a group must share (in the fingerprint when not the default)."""
        return self.max_weight_share, self.clip_norm_ratio, self.aggregation, self.verify_parts


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

    # die while working towards this round (1-based; in the all-reduce: of its closing exchange, see
    # peers/node.py exchange_faults)
    kill_round: Optional[int] = None
    kill_phase: Literal["inner", "allreduce"] = "inner"  # mid inner steps, or inside the all-reduce
    step_delay: float = 0.0  # extra seconds per inner step: a slow peer (straggler)
    nan_round: Optional[int] = None  # this peer's local model turns NaN halfway through this round (1-based)
    kill_rank: Optional[int] = None  # a multi-process peer: only this rank kills itself (None: every rank)
    # While `hold_file` exists, wait before working towards round `hold_round` (0: before joining the swarm at
    # all, publishing nothing). A test or `swarm local --join` starts the peer early and lets it go on cue, so
    # that a process start-up (seconds, more on a loaded machine) never races the swarm's rounds.
    hold_round: Optional[int] = None
    hold_file: str = ""
    hostile: list[str] = field(default_factory=list)  # attacks this peer makes (swarm/net/hostile.py ATTACKS)


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
            **({"robust": robust} if (robust := self.swarm.robust_rule()) != (1.0, 0.0, "mean", False) else {}),
        }
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


PER_PEER_KEYS = frozenset({
    "diloco.device", "diloco.global_device", "diloco.threads",
    "inner.micro_batch_size", "inner.activation_checkpointing",
    "data.shard",
    "swarm.identity", "swarm.host_maddrs", "swarm.announce_maddrs", "swarm.client_mode", "swarm.initial_peers",
    "swarm.bootstrap_timeout",
    "checkpoint", "logging", "faults",
})
"""Keys (dotted, or a whole section) that are this peer's own business: where and how fast it computes, its
address and key, its files, its fault injection. Everything else is the run's: a run's manifest
(swarm/net/manifest.py) holds the config without these, and `swarm join` lets a peer override only these.
`inner.micro_batch_size` and `inner.activation_checkpointing` change memory, not the step (up to float
rounding); `inner.precision` changes the step's arithmetic, so it is the run's. `swarm.bootstrap_timeout`
bounds only this peer's own start-up on its own link."""


def is_per_peer(key: str) -> bool:
    """Whether dotted `key` (e.g. "checkpoint.dir") is one of PER_PEER_KEYS or inside one of its sections."""
    return key in PER_PEER_KEYS or key.partition(".")[0] in PER_PEER_KEYS


def live_window(s: SwarmConfig) -> float:
    """A peer whose progress record was not refreshed for this long is gone: its heartbeat re-stores it every
    `progress_interval`, and one store may take up to `request_timeout`."""
    return 5 * s.progress_interval + 2 * s.request_timeout
