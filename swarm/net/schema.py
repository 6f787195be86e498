"""The one place that defines what `swarm` stores in the DHT.

All keys live under the run prefix `cfg.run_id`, so several runs can share one DHT (and one stock
`hivemind-dht` bootstrap). hivemind's `SchemaValidator(schema, prefix=run_id)` maps field `f` of
`RunSchema` to the raw DHT key `f"{run_id}_{f}"`:

- `{run_id}_progress`  dictionary, subkey = peer id (base58 str), value = `ProgressRecord.dict()`;
  expires `cfg.progress_expiration` after it was written: a peer that stops publishing is gone.
- `{run_id}_run`       the run fingerprint (str, `Config.fingerprint()`): what peers must share to
  average together. The first peer writes it; later peers with a different fingerprint refuse to join.

Matchmaking keys are hivemind's own (`{run_id}_{fingerprint}.0b<round bits>`, see matchmaking.py);
P2P handler names are built by `handler_name()`.

Numbers use strict pydantic types: `SchemaValidator` rejects any record that needs a type conversion.
"""

from __future__ import annotations

import re
from typing import Optional

from hivemind.dht.schema import SchemaValidator
from pydantic.v1 import BaseModel, StrictBool, StrictFloat, StrictStr, ValidationError, confloat, conint

RUN_RECORD_EXPIRATION = 7 * 24 * 3600.0
"""The fingerprint outlives every peer of a run by this much; a DHT needs an expiration for everything."""


class ProgressRecord(BaseModel):
    """How far one peer is. `time` is hivemind DHT time (`get_dht_time()`) when it was written."""

    peer_id: StrictStr
    name: StrictStr
    round: conint(ge=0, strict=True)
    inner_step: conint(ge=0, strict=True)
    samples: conint(ge=0, strict=True)
    samples_per_s: confloat(ge=0.0, strict=True)
    time: StrictFloat
    serves_state: StrictBool  # True once the peer has offered a state (it can be a donor)
    ready: StrictBool = False  # True once it finished this round's inner steps and looks for a group


class RunSchema(BaseModel):
    progress: dict[StrictStr, Optional[ProgressRecord]]
    run: StrictStr


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def run_key(run_id: str) -> str:
    return f"{run_id}_run"


def _safe(text: str) -> str:
    """hivemind group keys and handler names must not contain '.' (GROUP_PATTERN in key_manager.py)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


def matchmaking_prefix(run_id: str, fingerprint: str) -> str:
    """Averager prefix: peers of another run, or of this run with other settings, never meet."""
    return f"{_safe(run_id)}_{_safe(fingerprint)}"


def handler_name(run_id: str, fingerprint: str, what: str) -> str:
    """P2P handler name, e.g. `swarm_<run>_<fp>_push`; one namespace per run and fingerprint."""
    return f"swarm_{matchmaking_prefix(run_id, fingerprint)}_{what}"


def validators(run_id: str) -> list[SchemaValidator]:
    return [SchemaValidator(RunSchema, allow_extra_keys=True, prefix=run_id)]


def parse_progress(value: object) -> Optional[ProgressRecord]:
    """A `ProgressRecord` from a DHT value, or None if it does not fit the schema."""
    try:
        return ProgressRecord.parse_obj(value)
    except ValidationError:  # also raised for a non-dict value: a record we cannot use is no record
        return None
