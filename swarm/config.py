"""Typed configuration: one dataclass per concern, composed under `Config`. Loaded (a YAML file, dotted
command-line overrides, every key and type checked, cross-field rules) by swarm/run/configfile.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

MAX_IDENTITY_WORK = 27  # the most `swarm.identity_work` may ask: under a minute's search on one core


class ConfigError(ValueError):
    """A bad config: the message is one line and names the culprit key or file."""


@dataclass
class ModelConfig:
    """The causal LM: built from these shapes (seeded random init) or loaded from `pretrained`."""

    pretrained: Optional[str] = None
    """A local Hugging Face model folder to start from (warm start, swarm/state/pretrained.py), e.g. one `swarm export`
    wrote; the shapes below are then ignored. Each peer's own path to its copy: the run holds the weights' hash
    (swarm/run/runid.py), not their path."""
    hidden_size: int = 64  # width of the residual stream (Llama hidden_size)
    num_layers: int = 2  # transformer blocks
    num_heads: int = 4  # attention heads
    num_kv_heads: Optional[int] = None  # None: same as num_heads (no grouped-query attention)
    intermediate_size: int = 172  # width of each block's SwiGLU MLP
    max_seq_len: int = 256  # longest sequence the model's rotary positions are built for (>= data.seq_len)
    vocab_size: Optional[int] = None  # None: taken from the tokenizer
    seed: int = 0  # random init seed: every peer of a run must build the same initial weights


@dataclass
class DataConfig:
    """Where tokens come from and how each peer's shard is cut."""

    source: Literal["embedded", "hf"] = "embedded"  # embedded: a pinned CPython stdlib source snapshot, no download
    dataset: Optional[str] = None  # source=hf: hub name or local path (folder or .txt/.json/.jsonl/.parquet file)
    dataset_config: Optional[str] = None  # the dataset's configuration name, if it has several (source=hf)
    split: str = "train"  # split of the dataset to read (source=hf)
    text_field: str = "text"  # field of each record that holds its text (source=hf)
    streaming: bool = True  # source=hf: read the dataset as a stream (no full download first)
    tokenizer: str = "bytes"  # "bytes" (256 symbols, no download) or a tokenizer name/path for AutoTokenizer
    seq_len: int = 128  # tokens per training window (sequence)
    batch_size: int = 8  # sequences per inner step for the whole peer (split over its ranks)
    num_shards: int = 64  # the training stream is cut into this many disjoint shards
    shard: Optional[int] = None  # this peer's shard; None: a free one leased through the swarm (solo: 0)
    eval_fraction: float = 0.05  # share of documents held out for eval; no shard ever trains on them
    eval_batches: int = 8  # fixed held-out batches every eval reads
    max_documents: Optional[int] = None  # cap on documents read (embedded corpus / hf), None: all
    seed: int = 0  # seed of the eval split, the shards and the batch order (with the peer's name)
    cache_dir: Optional[str] = None
    """Where prepared corpora (token files, swarm/data/tokens.py) live; None: $XDG_CACHE_HOME/swarm/tokens, by default
    ~/.cache/swarm/tokens. `swarm data prepare` writes where a peer with the same data settings looks."""
    prepare_workers: Optional[int] = None
    """Processes that tokenize when a corpus is prepared (`swarm data prepare`, or a peer preparing its own);
    None: one per core for a Hugging Face tokenizer, one for bytes (a copy that workers only slow down). The token
    files are the same whatever the number."""


@dataclass
class InnerConfig:
    """The local AdamW optimizer each peer runs for H inner steps per round."""

    lr: float = 1e-3  # peak learning rate (after warmup; cosine decay to lr * min_lr_ratio)
    weight_decay: float = 0.1  # AdamW weight decay
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 20  # inner steps of linear warmup at the start of the run
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
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """How the ranks of a peer of several processes (`--nproc-per-node K`) share its work (swarm/train/sharding.py).
    ddp: every rank holds the whole model, its AdamW moments, the global parameters and the outer momentum.
    fsdp: FSDP2 `fully_shard` per transformer block and at the root; each rank holds 1/K of all of them, and
    of the outer step. The same step either way (up to float rounding), so peers of either kind, and of any K,
    average together. With one rank, fsdp is the same as no sharding (nothing to shard over)."""


@dataclass
class OuterConfig:
    """The outer optimizer: SGD with Nesterov momentum on the global parameters."""

    lr: float = 0.7  # outer learning rate of the Nesterov SGD step on the averaged pseudo-gradient
    momentum: float = 0.9  # outer momentum
    nesterov: bool = True  # Nesterov momentum (with momentum > 0)


@dataclass
class DilocoConfig:
    """The two-level loop: `rounds` rounds of `inner_steps` (H) inner steps each, every round closed by an outer
    step (with `fragments` F, by the last of its F outer steps)."""

    rounds: int = 6  # rounds in the run; each closes with an outer step
    inner_steps: int = 50  # H: inner steps per round
    eval_every: int = 1  # rounds between held-out evals
    device: str = "cpu"  # where the model trains: cpu, cuda, cuda:<i>
    global_device: str = "cpu"  # where the fp32 global parameters and outer momentum live
    threads: int = 0  # torch intra-op threads for this peer; 0 leaves torch's default
    delay: Union[int, Literal["auto"]] = 0
    """Inner steps by which a round's outer step trails its end (swarm/train/overlap.py): 0 stops computing while the
    peers average; tau >= 1 averages round r behind the first tau inner steps of round r+1 and applies the
    result after them, waiting there if it has not arrived. Pick tau so that tau inner steps outlast a round's
    matchmaking and all-reduce. auto (the shipped configs): a tenth of the inner steps between two exchanges,
    (inner_steps // fragments) // 10, so that changing H never makes a config invalid. A config that says
    nothing blocks."""
    fragments: int = 1
    """Streaming DiLoCo (swarm/train/fragments.py): F contiguous fragments of the parameter tensors, fragment f
    exchanged after inner step (f + 1) * inner_steps // F of each round: F exchanges of ~1/F of the bytes per round."""
    mix_alpha: float = 0.0
    """Where an exchange lands, local <- alpha * local + (1 - alpha) * (new global + the inner steps taken since
    it started): 0 takes the group's outer step fully (plain DiLoCo), 1 keeps the peer's own stand-in."""


@dataclass
class SwarmConfig:
    """The network: DHT bootstrap, matchmaking and all-reduce. Every time-out is finite."""

    run_id: str = "swarm-tiny"  # DHT key prefix; several runs can share one DHT
    initial_peers: list[str] = field(default_factory=list)  # multiaddrs of peers already in the swarm; none: start one
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    """Multiaddrs this peer listens on: by default every interface, on any free port (`--port P` fixes it: the
    TCP port to open in a firewall). /ip4/127.0.0.1/tcp/0 keeps a peer to this machine."""
    announce_maddrs: list[str] = field(default_factory=list)
    """Multiaddrs others dial this peer at (`--announce-ip IP`); default: the addresses it listens on."""
    data_plane: bool = True
    """Move the all-reduce's bulk bytes to a direct TCP connection (sealed with AES-GCM, keyed over libp2p) to each
    groupmate that can be dialed, falling back to libp2p where it cannot (swarm/net/dataplane.py); it spares the
    bytes two trips through the p2pd daemons (bench/results/README.md, §12). False: everything over libp2p."""
    data_port: int = 0
    """The TCP port of the data plane (0: any free port): the second port to open in a firewall; a groupmate that
    cannot reach it falls back to libp2p (slower, nothing lost)."""
    corpus_rate: float = 25e6
    """Bytes/s this peer sends its prepared corpus to each peer that fetches it (`swarm join` on a machine without
    it; swarm/net/corpussync.py, at most 2 at once): the cap that keeps serving data from slowing its rounds. At least
    `min_bandwidth`, below which a fetcher gives up on a piece."""
    identity: Optional[str] = None
    """This peer's key file (created if missing): its peer id and the signature on its DHT records
    (swarm/net/identity.py). None: `identity.key` in the peer's folder, so that a restart keeps its peer id and
    stays known to the others' ledgers (swarm/net/ledger.py)."""
    auth: Literal["open", "allowlist"] = "open"
    """open: anyone may join. allowlist: only `allowed_peers` may write this run's DHT records, meet in
    groups, send to the all-reduce or download the state (a private swarm)."""
    allowed_peers: list[str] = field(default_factory=list)  # base58 peer ids (`swarm.auth: allowlist`)
    identity_work: int = 0
    """Bits of proof of work a peer id needs to count (swarm/net/work.py): with B > 0 every peer searches, once
    per key, a nonce whose sha256 with its public key starts with B zero bits (2^B hashes, ~3.4 M/s per core),
    and records, fingerprint votes, manifest copies and group seats of peer ids without one are ignored.
    0: off. At most 27 (under a minute's search on one core). `swarm join` takes it as an option too (the work it
    demands of the peers whose manifests it counts)."""
    client_mode: bool = False
    """True for a peer that cannot be dialed (behind a NAT or a firewall; `swarm peer --client-mode`): it only
    dials out, averages with the swarm but owns no part of the all-reduce, never leads a group and never serves
    its state. Every group needs at least one peer that is not a client. No libp2p relay is involved: a client
    needs none to dial out, and a relayed (circuit v2) connection is capped far below a round's bytes."""
    target_group_size: int = 64  # a group forms at once when this many peers are ready
    min_group_size: int = 2  # fewest peers a group needs to average (hivemind matchmaking)
    compression: Literal["none", "fp16", "int8", "int4"] = "int8"
    """How pseudo-gradients travel in the all-reduce (reduction is always fp32): int8 (blockwise, ~0.27x the bytes of
    none; the default: on the convergence point its eval loss is within noise of fp32, bench/results §13), none
    (fp32), fp16, int4 (blockwise, ~0.16x). Tensors under 8192 elements always travel in fp32. Wire formats and
    measured errors: swarm/net/codec.py."""
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
    # Bounded influence (swarm/net/allreduce/robust.py, audit.py): on by default, since an open swarm holds
    # strangers; the values are those the hostile table was measured with (bench/results/README.md), and on
    # configs/tiny.yaml they cost an unattacked 4-peer run nothing measurable (eval loss 2.6698 +- 0.011 vs
    # 2.6707 +- 0.005 with the plain weighted mean, 3 runs each). A private swarm (swarm.auth: allowlist) may
    # set max_weight_share 1, clip_norm_ratio 0 and aggregation mean for the exact sample-weighted mean; an
    # open swarm that does is warned at start.
    max_weight_share: float = 0.5
    """In (0, 1], 1 = off: cap on one member's share of its group's weight (water-filling; equal shares if
    fewer than 1/cap members have samples, e.g. in a group of 2). A claim of 1e30 samples gets 0.5."""
    clip_norm_ratio: float = 4.0
    """0 = off, or >= 1: each member's chunk is scaled down to this x the median of the members' norms of
    that chunk (per chunk: an owner never holds a whole part). Bounds a huge pseudo-gradient."""
    aggregation: Literal["mean", "trimmed_mean", "centered_clip"] = "trimmed_mean"
    """A part owner's per-chunk reducer: weighted mean, coordinate-wise trimmed mean (drops the 20% highest
    and lowest values of every coordinate, at least one each from 3 members on), or centered clip."""
    verify_parts: bool = True
    """Each member recomputes one random chunk of every other part and fails the round on a lying owner (a
    part owner otherwise sets its part of the average alone: +184% eval loss in the hostile table's bad-part
    row). A client (swarm.client_mode) brings its contributions on a stream it opens to each owner; two clients
    cannot reach each other, so a client leaves unchecked the parts another client contributed to. Costs
    (n-1)^2 chunks fetched per member and round (audit.py); on tiny.yaml +0.2% eval loss (noise)."""

    def relaxed(self) -> list[str]:
        """The bounds on one peer's influence this config turns off (a private swarm may; an open one should not)."""
        return [text for off, text in ((self.max_weight_share >= 1.0, "max_weight_share 1"),
                                       (self.clip_norm_ratio == 0.0, "clip_norm_ratio 0"),
                                       (self.aggregation == "mean", "aggregation mean"),
                                       (not self.verify_parts, "verify_parts false")) if off]


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None: <out>/checkpoint
    every: int = 1  # rounds between checkpoints; 0 disables
    keep: int = 1  # the newest checkpoints kept (older ones are deleted once a newer one is complete)
    resume: bool = True  # resume from dir if a checkpoint is there


@dataclass
class LoggingConfig:
    """What a peer shows and keeps: log.txt and metrics.csv always, in its run folder; these add the rest."""

    progress_bar: bool = True  # a live progress bar on a terminal (else, or off: a plain line every progress_every)
    progress_every: float = 60.0  # seconds between two plain progress lines (no terminal, or progress_bar off)
    tensorboard: bool = False  # also write TensorBoard event files to <out>/tensorboard (needs swarm[tensorboard])
    wandb: Optional[str] = None  # a Weights & Biases project to log every round to (pip install swarm[wandb])
    wandb_mode: Literal["online", "offline"] = "online"  # offline: a local run folder, `wandb sync` uploads it later
    dump_tensors: bool = False  # write each round's pseudo-gradient, weight and new global params to <out>/tensors


# The attacks a hostile peer can make (`faults.hostile`, `swarm local --hostile KIND@PEER`), by name, with what
# catches each; the attacks themselves are in swarm/net/hostile.py.
ATTACKS = {
    "forge-progress": "its progress record claims it finished every round at once (ready), and every other "
                      "heartbeat a far-future round it serves the state of (policy.plausible, majority ready)",
    "claim-ahead": "its progress records claim one round more than it holds, on its real hash, serving (the quorum "
                   "rule of policy.py: one voter of several is never half of them)",
    "forged-commit": "its commit records claim one round more than it committed, on a hash nobody holds (commits "
                     "count only when no other voter is live)",
    "nan": "sends NaN in its pseudo-gradient (owners refuse the part and name it)",
    "huge": "sends its pseudo-gradient times 1e6, finite (swarm.clip_norm_ratio, robust aggregation)",
    "weight": "claims 1e18 samples (the most a strict int carries) in matchmaking and as its weight "
              "(swarm.max_weight_share)",
    "bad-part": "returns a wrong average for the part it owns (swarm.verify_parts)",
    "audit-lie": "answers its groupmates' audits with other bytes than it sent the owner (allreduce/evidence.py: "
                 "its own signature over what it sent names it)",
    "frame": "leads matchmaking (waits a third of swarm.matchmaking_time) and hands its followers forged metas "
             "of their groupmates, malformed (signedmeta: every member signs its own meta; the followers charge "
             "the leader, never each other)",
    "replay": "leads matchmaking and hands its followers each member's signed meta of an earlier round (a meta "
              "names its round and attempt's nonce: the member whose meta it is charges the leader; the others "
              "leave the group charging nobody, matchmaking.misfit)",
    "lying-owner": "sends one member other bytes of its part's average than the others (allreduce/agree.py: "
                   "members compare their owners' signed digests before committing)",
    "stall-round": "signs matchmaking metadata of another round (matchmaking.misfit names the member that signed it)",
    "stall-numel": "signs matchmaking metadata with another vector size (matchmaking.misfit names it)",
    "stall-token": "puts another token in the matchmaking barrier than its meta says (the barrier decides only "
                   "a round's first attempt; then the all-reduce's HELLOs do)",
    "stall-silent": "pushes all but the last chunk of each part, then holds its streams open, silent (each "
                    "owner names it: SEEN, left out for the averaging attempt)",
    "garbage-meta": "sends matchmaking metadata that does not fit (matchmaking.GroupMeta, then a ban)",
    "poison-state": "serves a state with the right shapes and wrong values under the committed hash (the "
                    "newcomer hashes what it downloads)",
    "poison-momentum": "serves its state with its outer momentum reversed and ten times larger (finite, same "
                       "shapes) under its real committed hash (the state's hash covers the momentum: "
                       "swarm/state/statehash.py; the newcomer refuses it naming the donor and takes another's)",
    "flood": "opens all-reduce streams for groups it is not in, as many as it can (allreduce: per-peer cap "
             "on pending groups)",
    "trickle": "holds streams open on every handler of every peer, a byte of a maximal HELLO per half stall "
               "(limits: streams per peer; wire: the first frame's deadline, then a ban)",
    "sybil": "mints identities that sign a forged fingerprint and manifest (swarm.identity_work: a proof of "
             "work per identity; without it a newcomer counts them as peers)",
    "sybil-quorum": "mints 8 identities that sign progress and commit records one round ahead of its own, on a "
                    "perturbed hash they say they serve, from the run's second round on (no certificate backs "
                    "their votes: the quorum counts none of them, certificates.py; alone, the ledger)",
}


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
    hold_file: str = ""  # the file whose existence holds the peer (faults.hold_round)
    hostile: list[str] = field(default_factory=list)  # attacks this peer makes (ATTACKS above)


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


PER_PEER_KEYS = frozenset({
    "diloco.device", "diloco.global_device", "diloco.threads",
    "inner.micro_batch_size", "inner.activation_checkpointing", "inner.parallel",
    "data.shard", "data.cache_dir", "data.prepare_workers", "model.pretrained",
    "swarm.identity", "swarm.host_maddrs", "swarm.announce_maddrs", "swarm.client_mode", "swarm.initial_peers",
    "swarm.bootstrap_timeout", "swarm.data_plane", "swarm.data_port", "swarm.corpus_rate",
    "checkpoint", "logging", "faults",
})
"""Keys (dotted, or a whole section) that are this peer's own business: where and how fast it computes, its
address and key, its files (`data.cache_dir`, where its prepared corpus lies: the run holds the corpus's
hash; `model.pretrained` too: the run holds the weights' hash, not their path), its fault injection.
Everything else is the run's: a run's manifest (swarm/net/manifest.py) holds the config without these, and
`swarm join` lets a peer override only these.
`inner.micro_batch_size`, `inner.activation_checkpointing` and `inner.parallel` change memory, not the step (up
to float rounding); `inner.precision` changes the step's arithmetic, so it is the run's. `swarm.bootstrap_timeout`
bounds only this peer's own start-up on its own link."""


CORPUS_LOCATION_KEYS = frozenset({"data.dataset", "data.dataset_config", "data.split", "data.text_field",
                                  "data.streaming", "data.tokenizer"})
"""Keys that say where this peer's copy of the run's corpus lies and how to read it, not what it holds: the run
pins the content instead (the prepared corpus's hash, swarm/run/runid.py), so they are left out of the run's
fingerprint, and a copy anywhere joins (`--data.dataset /my/copy`) while a copy that tokenizes to other tokens is
refused with both hashes. The run's manifest keeps its starter's values, as where to find the corpus: `swarm join`
starts from them and takes this peer's own."""


def is_per_peer(key: str) -> bool:
    """Whether dotted `key` (e.g. "checkpoint.dir") is one of PER_PEER_KEYS or inside one of its sections."""
    return key in PER_PEER_KEYS or key.partition(".")[0] in PER_PEER_KEYS


def per_peer_keys() -> list[str]:
    """PER_PEER_KEYS as a user reads them: dotted keys, and `section.*` for a whole section."""
    return sorted(k if "." in k else f"{k}.*" for k in PER_PEER_KEYS)


def joinable_keys() -> list[str]:
    """What `swarm join` lets a peer set: its own keys, and where its copy of the run's corpus lies (its content
    must be the run's: CORPUS_LOCATION_KEYS)."""
    return sorted([*per_peer_keys(), *CORPUS_LOCATION_KEYS])


def shared_config(cfg: Config) -> dict[str, dict]:
    """The run's config: `Config.to_dict()` without PER_PEER_KEYS. What a run's manifest holds and its
    fingerprint hashes (swarm/run/runid.py): every peer of a run holds the same."""
    out = {}
    for section, values in cfg.to_dict().items():
        if section not in PER_PEER_KEYS:
            out[section] = {k: v for k, v in values.items() if not is_per_peer(f"{section}.{k}")}
    return out


def live_window(s: SwarmConfig) -> float:
    """A peer whose progress record was not refreshed for this long is gone: its heartbeat re-stores it every
    `progress_interval`, and one store may take up to `request_timeout`."""
    return 5 * s.progress_interval + 2 * s.request_timeout
