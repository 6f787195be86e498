"""The one place that defines what `swarm` stores in the DHT.

All keys live under the run prefix `cfg.run_id`, so several runs can share one DHT (and one stock
`hivemind-dht` bootstrap). hivemind's `SchemaValidator(schema, prefix=run_id)` maps field `f` of
`RunSchema` to the raw DHT key `f"{run_id}_{f}"`:

Every record is owned and signed (identity.py): its subkey is the writer's owner marker
`[owner:<RSA public key>]` and its value carries the writer's signature (hivemind's `RSASignatureValidator`,
checked by every DHT node that stores it and every peer that reads it). `read_owned` derives each record's
peer id from that key, so a peer can only ever speak for itself.

Wire names: the records keep the field names every version of the protocol stores and reads. `round` in
`Statement`, `ProgressRecord` and `CommitRecord`, and in a state manifest (statesync.py), is a count of outer steps
(swarm/__init__.py: with `diloco.fragments` F a round holds F of them); each record reads it as `.outer_step`, and
the code and its logs say outer step (`WIRE_NAMES`).

- `{run_id}_progress`  dictionary, subkey = owner marker, value = `ProgressRecord.dict()`;
  re-stored by the peer's heartbeat every `progress_interval`, expires `cfg.progress_expiration` after it
  was written. Liveness is read from its `time` (`policy.py`), expiry only removes the dead. Its optional
  fields (`loss`, `tokens_per_s`, `bytes_sent`, `bytes_received`, `eval_loss`, `eval_round`) are for
  watchers only (`swarm monitor`, swarm/monitor/): no peer decides anything on them. Each defaults to None
  (not known yet); a peer always stores every field, so the DHT's strict check (`parse_obj(v).dict() ==
  v`) holds, and a non-finite number is stored as None (NaN != NaN would fail that check).
- `{run_id}_commits`   dictionary, subkey = owner marker, value = `CommitRecord.dict()`: the last outer step each peer
  committed or downloaded and its hash; kept `RUN_RECORD_EXPIRATION`, long after the peer left, so a peer
  that comes back late knows how far the swarm got (and never trains on alone from an older outer step). It carries
  the peer's signed `Statement`s of its last `STATEMENTS` commits (its progress record the last one, so that a
  claim and what backs it arrive together): the certificates the quorum counts votes by (certificates.py).
- `{run_id}_run`       dictionary, subkey = owner marker, value = `RunRecord.dict()`: the run fingerprint
  (swarm/run/runid.py: the run config, corpus and initial weights) each peer joined with, what peers must share
  to average together. A peer whose fingerprint differs from the one most peers of the run signed refuses
  to join (dht.py), naming the first key that differs (read from the run's manifest).

- `{run_id}_manifest`  dictionary, subkey = owner marker, value = `ManifestRecord.dict()`: the run's config
  without the per-peer keys (`config.PER_PEER_KEYS`) and the hashes of its corpus and initial weights, what
  `swarm join RUN` starts a peer from and what a refused peer is compared with. The peer
  that creates the run stores it; a later peer whose own config equals the chosen manifest's re-stores it
  under its own key while fewer than `MANIFEST_COPIES` peers hold it, so it outlives the creator. Signed
  like every record; a reader believes only a manifest whose fingerprint is the run's (the majority of
  `{run_id}_run`) and whose config reproduces it (swarm/net/manifest.py). Kept `RUN_RECORD_EXPIRATION`.
- `{run_id}_leases`    dictionary, subkey = owner marker, value = `LeaseRecord.dict()`: the data shard each peer
  holds and how far it read it (swarm/data/leases.py is the policy, swarm/net/leases.py the store and reads).
  Stored when a peer takes a shard and re-stored at every outer step's close. A lease is live while its `time`
  is within the live window or its owner's progress record is live (`config.live_window`): a dead peer's
  lease expires with its heartbeat. The record itself is kept `RUN_RECORD_EXPIRATION`, so that the samples
  drawn from each shard are known after its holder left (newcomers take the least-used free shard) and a
  restarted peer finds its own lease (by owner, or by name with a fresh key) and takes its shard back.
- `swarm_runs` (`INDEX_KEY`, the one key outside any run's prefix) dictionary, subkey = owner marker, value =
  `IndexRecord.dict()` {run_id, fingerprint, params, time}: the runs this DHT knows, for `swarm runs` (a
  Kademlia DHT cannot be listed). The creator of an open run stores an entry, later peers re-store theirs
  while fewer than `INDEX_COPIES` entries name their run; one entry per peer key (a key in two runs keeps
  only its latest). A private swarm (`swarm.auth: allowlist`) does not advertise itself. Kept
  `RUN_RECORD_EXPIRATION`; `swarm runs` shows at most `MAX_RUNS_SHOWN` runs, live ones first.

Matchmaking keys are hivemind's own (`{run_id}_{fingerprint}.0b<outer step bits>`, see matchmaking.py);
P2P stream names are built by `handler_name()`.

Numbers use strict pydantic types: `SchemaValidator` rejects any record that needs a type conversion.

Bounds on what a stranger can make every reader hold (`read_owned` applies them, whoever stored the record):
- one record per owner and key: an owner marker subkey is exactly `[owner:ssh-rsa <base64>]` (hivemind's
  own pattern also admits `[owner:K]x[owner:K]`, one owner's unlimited further subkeys);
- strings: names and peer ids at most `MAX_NAME` characters, hashes and fingerprints their own length;
- times: a record whose `time` is more than `MAX_CLOCK_SKEW` s ahead of the reader's clock (it would look
  live for ever), or whose expiration lies further ahead than the writer may set (`progress_expiration` for
  progress records, `RUN_RECORD_EXPIRATION` for the others, plus MAX_CLOCK_SKEW), is no record;
- identities (`swarm.identity_work`, work.py): with B > 0 bits, a record counts only if its `work` nonce
  proves B bits of work on its owner's key.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator, conbytes
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer
from pydantic.v1 import (
    BaseModel,
    StrictBool,
    StrictFloat,
    StrictStr,
    ValidationError,
    confloat,
    conint,
    conlist,
    constr,
    validator,
)

from swarm.net.identity import Identity, owner_key, owner_peer_id
from swarm.net.work import proves

RUN_RECORD_EXPIRATION = 7 * 24 * 3600.0
"""The fingerprint and commit records outlive every peer of a run by this much; a DHT needs an expiration."""
MAX_CLOCK_SKEW = 60.0
"""Seconds a record's time (or its expiration past the writer's limit) may lie ahead of the reader's clock: the
±1 min that hivemind's access tokens allow between the clocks of two machines."""
MAX_NAME = 128  # characters of a peer name or peer id in a record

Sha256 = constr(regex=r"^([0-9a-f]{64})?$", strict=True)
Owner = conbytes(regex=rb"^\[owner:ssh-rsa [A-Za-z0-9+/]+={0,2}\]$", max_length=2048)
Finite = confloat(strict=True, allow_inf_nan=False)
Name = constr(max_length=MAX_NAME, strict=True)
Work = conint(ge=0, lt=2**64, strict=True)  # the nonce of the owner's proof of work (work.py); 0 without


WIRE_NAMES = {"outer_step": "round"}
"""What the code calls a record's field -> its name on the wire (module docstring); each record with the field has
the code's name as a read-only property."""

STATEMENTS = 16
"""Statements a peer keeps in its commit record: its last commits, the window a certificate chain is read over."""
MAX_GROUP = 4096  # members a statement may name (a group beyond this was not formed by matchmaking)


class Statement(BaseModel):
    """One member's signature in an outer step's certificate (certificates.py): "I committed outer step `outer_step`,
    from the global parameters `parent` to `sha256`, in group `group` of `size` members" (alone: group "", size 1).
    Signed with the record that carries it; the members of one group that sign the same statement, at least half
    of `size`, are its certificate."""

    round: conint(ge=1, strict=True)  # wire name of the outer step (WIRE_NAMES)
    parent: Sha256
    sha256: Sha256
    group: constr(regex=r"^([0-9a-f]{1,128})?$", strict=True)  # the matchmaking group id, hex
    size: conint(ge=1, le=MAX_GROUP, strict=True)

    @property
    def outer_step(self) -> int:
        return self.round


class ProgressRecord(BaseModel):
    """How far one peer is. `time` is hivemind DHT time (`get_dht_time()`) when it was written."""

    peer_id: Name
    name: Name
    round: conint(ge=0, strict=True)  # wire name of the outer steps this peer's global parameters hold
    inner_step: conint(ge=0, strict=True)
    samples: conint(ge=0, strict=True)
    samples_per_s: confloat(ge=0.0, strict=True)
    time: StrictFloat
    serves_state: StrictBool  # True once the peer has offered a state (it can be a donor)
    ready: StrictBool = False  # True once it finished this outer step's inner steps and looks for a group
    sha256: Sha256 = ""  # hash of its global parameters at `outer_step` ("" not known yet)
    # For watchers (swarm monitor) only; None: not known yet.
    loss: Optional[Finite] = None  # training loss of its last inner step
    tokens_per_s: Optional[confloat(ge=0.0, strict=True, allow_inf_nan=False)] = None  # over this outer step's steps
    bytes_sent: Optional[conint(ge=0, strict=True)] = None  # all-reduce payload since the peer started
    bytes_received: Optional[conint(ge=0, strict=True)] = None
    eval_loss: Optional[Finite] = None  # held-out loss of its global parameters at `eval_round`
    eval_round: Optional[conint(ge=0, strict=True)] = None
    work: Work = 0
    statement: Optional[Statement] = None  # its last commit's statement: arrives with the claim it backs

    @property
    def outer_step(self) -> int:
        return self.round


class CommitRecord(BaseModel):
    """The last outer step a peer committed (or downloaded) and the hash of its global parameters then, with the
    statements of its last STATEMENTS commits, oldest first (the chain a certificate is read back along)."""

    name: Name
    round: conint(ge=0, strict=True)  # wire name of the outer step (WIRE_NAMES)
    sha256: Sha256
    time: StrictFloat
    work: Work = 0
    statements: conlist(Statement, max_items=STATEMENTS) = []

    @property
    def outer_step(self) -> int:
        return self.round


class RunRecord(BaseModel):
    """The run fingerprint one peer joined with."""

    fingerprint: constr(max_length=64, strict=True)
    time: StrictFloat
    work: Work = 0


MANIFEST_VERSION = 2
"""The manifest layout this code writes and reads; a reader refuses a newer one (it may mean other things).
2: the fingerprint hashes the whole run config, the corpus and the initial weights (swarm/run/runid.py)."""
MAX_MANIFEST_BYTES = 16384
"""A config's JSON is a few KB (configs/llama-1b.yaml: ~2 KB); this bounds what a stranger can make every
reader parse and every DHT node store."""
MANIFEST_COPIES = 4  # peers that re-store a run's manifest under their own key: it outlives the creator
INDEX_KEY = "swarm_runs"
INDEX_COPIES = 3  # index entries per run: enough to outlive the creator, few enough to keep the index small
MAX_RUNS_SHOWN = 100  # runs `swarm runs` reads and prints (the index is written by strangers too)


class ManifestRecord(BaseModel):
    """A run's config without the per-peer keys, signed by the peer that stored it."""

    config: dict[StrictStr, dict[StrictStr, Any]]  # Config.to_dict() minus config.PER_PEER_KEYS
    fingerprint: constr(max_length=64, strict=True)  # RunIdentity.fingerprint of the three below, as its writer says
    creator: constr(max_length=64, strict=True)  # peer id of the peer that created the run (as the writer knows)
    time: StrictFloat
    version: conint(ge=1, strict=True)
    corpus_sha256: constr(max_length=64, strict=True) = ""  # the run's prepared corpus (swarm/run/runid.py)
    weights_sha256: Optional[constr(max_length=64, strict=True)] = None  # model.pretrained's weights, if any
    work: Work = 0

    @validator("config")
    def _bounded(cls, value: dict) -> dict:  # noqa: N805 (pydantic's validator signature)
        try:
            size = len(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError):
            raise ValueError("config is not plain JSON") from None
        if size > MAX_MANIFEST_BYTES:
            raise ValueError(f"config is {size} bytes, over {MAX_MANIFEST_BYTES}")
        return value


class LeaseRecord(BaseModel):
    """The data shard one peer holds (swarm/data/leases.py), signed by it."""

    name: Name  # the peer's name: a restarted peer with a fresh key finds its lease by it
    shard: conint(ge=0, strict=True)
    since: StrictFloat  # DHT time when this peer's claim on the shard began (the earlier claim wins)
    samples: conint(ge=0, strict=True)  # samples this peer has drawn from the shard
    time: StrictFloat
    work: Work = 0


class IndexRecord(BaseModel):
    """One entry of the run index (`INDEX_KEY`): a run this DHT holds, for `swarm runs`."""

    run_id: constr(min_length=1, max_length=128, strict=True)
    fingerprint: constr(max_length=64, strict=True)
    params: conint(ge=0, strict=True)  # the model's parameter count
    time: StrictFloat


class RunSchema(BaseModel):
    progress: dict[Owner, Optional[ProgressRecord]]
    commits: dict[Owner, Optional[CommitRecord]]
    run: dict[Owner, Optional[RunRecord]]
    manifest: dict[Owner, Optional[ManifestRecord]]
    leases: dict[Owner, Optional[LeaseRecord]]


class IndexSchema(BaseModel):
    swarm_runs: dict[Owner, Optional[IndexRecord]]


def watched(loss: Optional[float] = None, tokens_per_s: Optional[float] = None, bytes_sent: Optional[int] = None,
            bytes_received: Optional[int] = None, eval_loss: Optional[float] = None,
            eval_round: Optional[int] = None) -> dict:
    """The optional fields of a ProgressRecord from plain numbers: a non-finite number or a negative count
    becomes None (not known), so the record always passes the strict check."""
    def number(x: Optional[float], low: float = -math.inf) -> Optional[float]:
        return float(x) if x is not None and math.isfinite(x) and x >= low else None

    def count(x: Optional[int]) -> Optional[int]:
        return int(x) if x is not None and x >= 0 else None

    return dict(loss=number(loss), tokens_per_s=number(tokens_per_s, 0.0), bytes_sent=count(bytes_sent),
                bytes_received=count(bytes_received), eval_loss=number(eval_loss), eval_round=count(eval_round))


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def commits_key(run_id: str) -> str:
    return f"{run_id}_commits"


def run_key(run_id: str) -> str:
    return f"{run_id}_run"


def manifest_key(run_id: str) -> str:
    return f"{run_id}_manifest"


def leases_key(run_id: str) -> str:
    return f"{run_id}_leases"


def _safe(text: str) -> str:
    """hivemind group keys and handler names must not contain '.' (GROUP_PATTERN in key_manager.py)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


def matchmaking_prefix(run_id: str, fingerprint: str) -> str:
    """Averager prefix: peers of another run, or of this run with other settings, never meet."""
    return f"{_safe(run_id)}_{_safe(fingerprint)}"


def handler_name(run_id: str, fingerprint: str, what: str) -> str:
    """P2P stream name, e.g. `swarm_<run>_<fp>_ar`; one namespace per run and fingerprint."""
    return f"swarm_{matchmaking_prefix(run_id, fingerprint)}_{what}"


class AllowlistValidator(RecordValidatorBase):
    """In a private swarm (`swarm.auth: allowlist`), DHT nodes refuse this run's records from strangers: a
    record under one of the run's keys counts only if its owner's peer id is in `swarm.allowed_peers`."""

    def __init__(self, run_id: str, allowed: frozenset[str]):
        self.allowed = allowed
        self.keys = {DHTID.generate(source=key(run_id)).to_bytes()
                     for key in (progress_key, commits_key, run_key, manifest_key, leases_key)}

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self.keys:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # msgpack raises several unrelated types on garbage; garbage is no owner
            return False
        return owner_peer_id(subkey) in self.allowed

    @property
    def priority(self) -> int:
        return 20  # validated before the signature is checked (cheaper) and the value is parsed


def validators(run_id: str, identity: Identity, allowed: Optional[frozenset[str]] = None) -> list[RecordValidatorBase]:
    """Schema (types, owner-marker subkeys) and signatures for every record; with `allowed`, owners too."""
    out = [SchemaValidator(RunSchema, allow_extra_keys=True, prefix=run_id),
           SchemaValidator(IndexSchema, allow_extra_keys=True), identity.validator()]
    if allowed is not None:
        out.append(AllowlistValidator(run_id, allowed))
    return out


def parse(model: type[BaseModel], value: object) -> Optional[BaseModel]:
    """A record of `model` from a DHT value, or None if it does not fit the schema."""
    try:
        return model.parse_obj(value)
    except ValidationError:  # also raised for a non-dict value: a record we cannot use is no record
        return None


def read_owned(found: object, model: type[BaseModel], now: float, work: int = 0,
               lifetime: float = RUN_RECORD_EXPIRATION) -> dict[str, BaseModel]:
    """The unexpired records of a DHT dictionary value (`dht.get(..., latest=True)`), by their owner's peer
    id. A record that does not fit `model`, a progress record naming another peer than its owner, one dated
    ahead of `now` or expiring later than `lifetime` from now (beyond MAX_CLOCK_SKEW), or one without `work`
    bits of proof of work on its owner's key, is no record."""
    if found is None or not isinstance(getattr(found, "value", None), dict):
        return {}
    records = {}
    for subkey, item in found.value.items():
        peer_id = owner_peer_id(subkey)
        record = parse(model, item.value) if peer_id is not None else None
        if isinstance(record, ProgressRecord) and record.peer_id != peer_id:
            record = None
        if record is None or not now < item.expiration_time <= now + lifetime + MAX_CLOCK_SKEW:
            continue
        if getattr(record, "time", now) > now + MAX_CLOCK_SKEW:
            continue
        if work > 0 and not proves(owner_key(subkey), getattr(record, "work", 0), work):
            continue
        records[peer_id] = record
    return records
