"""Records in the names of many identities, as one machine minting keys would store them (the `sybil` attack).

A DHT node signs only the records under its own key (hivemind's `RSASignatureValidator`), so `store_as`
signs a record with another key itself and hands it to the nodes nearest its key, inside the DHT's own
process (`DHT.run_coroutine`): the same bytes a DHT client of that key would send. Every honest node checks
the signature and the schema as for any record; nothing here gets past a check that a real second client
would not.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from dataclasses import dataclass
from typing import Optional

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

from swarm.config import shared_config
from swarm.net.work import public_key, search
from swarm.run.configfile import config_from_dict
from swarm.run.runid import RunIdentity

logger = logging.getLogger(__name__)


@dataclass
class Sybil:
    key: RSAPrivateKey
    owner: bytes  # its owner marker, the subkey of its records
    work: int  # the nonce of its proof of work (0 without)


def mint(count: int, bits: int, budget_s: float) -> tuple[list[Sybil], float]:
    """Up to `count` fresh identities, each with a proof of `bits` of work, minted within `budget_s` s (key
    generation and search together); returns them and the seconds spent per identity."""
    start, out = time.monotonic(), []
    while len(out) < count and time.monotonic() - start < budget_s:
        key = RSAPrivateKey()
        owner = RSASignatureValidator(key).local_public_key
        nonce = search(public_key(owner), bits, budget_s=max(0.0, budget_s - (time.monotonic() - start))) \
            if bits > 0 else 0
        if nonce is None:
            break
        out.append(Sybil(key, owner, nonce))
    return out, (time.monotonic() - start) / max(1, len(out))


async def _store_signed(key: str, value: dict, expiration: float, private_key: RSAPrivateKey, _dht,
                        node) -> int:
    """In the DHT's process: `value` under `key`, subkey = the key's owner marker, signed with `private_key`,
    sent to the nodes nearest `key`; returns how many took it."""
    validator = RSASignatureValidator(private_key)
    subkey = validator.local_public_key
    key_id = DHTID.generate(source=key)
    serializer = node.protocol.serializer
    record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), serializer.dumps(value), expiration)
    signed = validator.sign_value(record)
    nearest = (await node.find_nearest_nodes([key_id])).get(key_id, {})
    stored = 0
    for peer in nearest.values():
        answer = await node.protocol.call_store(peer, keys=[key_id], values=[signed], expiration_time=[expiration],
                                                subkeys=[subkey])
        stored += bool(answer and answer[0])
    return stored


def store_as(dht: hivemind.DHT, sybil: Sybil, key: str, value: dict, expiration: float,
             timeout: float) -> Optional[int]:
    """Store `value` under `key` as `sybil` (blocking, at most `timeout` s); how many nodes took it (None: no
    answer in time)."""
    future = dht.run_coroutine(functools.partial(_store_signed, key, value, expiration, sybil.key),
                               return_future=True)
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        return None


def forged_run(shared: dict, corpus_sha256: str = "", weights_sha256: Optional[str] = None) -> tuple[dict, str]:
    """The run's shared config with outer.lr x 10, and its fingerprint with the run's corpus and weights (a
    manifest that checks)."""
    forged = copy.deepcopy(shared)
    forged["outer"]["lr"] = float(forged["outer"]["lr"]) * 10
    loaded = shared_config(config_from_dict(copy.deepcopy(forged)))
    return forged, RunIdentity(loaded, corpus_sha256, weights_sha256).fingerprint
