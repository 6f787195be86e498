"""Hostile peers for demos and tests: the attacks a public swarm must survive (`faults.hostile`, and
`swarm local --hostile KIND@PEER`).

The protocol code calls a `Hooks` object at a few points where a peer's own behaviour could be altered
(the record it publishes, its matchmaking metadata, its weight, its encoded contribution, the average it
returns as a part owner, the state it serves); honest peers use the do-nothing `Hooks`. `Attacker` turns
those hooks against the swarm, one named attack each, like torchft's `EventInjector`: the attack lives here,
never as `if hostile:` branches inside the protocol. What catches each attack is listed with it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)

ATTACKS = {
    "forge-progress": "its progress record claims it finished every round at once (ready), and every other "
                      "heartbeat a far-future round it serves the state of (policy.plausible, majority ready)",
    "nan": "sends NaN in its pseudo-gradient (owners refuse the part and name it)",
    "huge": "sends its pseudo-gradient times 1e6, finite (swarm.clip_norm_ratio, robust aggregation)",
    "weight": "claims 1e30 samples as its weight (swarm.max_weight_share)",
    "bad-part": "returns a wrong average for the part it owns (swarm.verify_parts)",
    "garbage-meta": "sends matchmaking metadata that does not fit (matchmaking.GroupMeta, then a ban)",
    "poison-state": "serves a state with the right shapes and wrong values under the committed hash (the "
                    "newcomer hashes what it downloads)",
    "flood": "opens all-reduce streams for groups it is not in, as many as it can (allreduce: per-peer cap "
             "on pending groups)",
}
FORGED_ROUND = 2**40


class Hooks:
    """A peer's own behaviour at the protocol's hook points; this base class changes nothing."""

    def progress(self, record: dict) -> dict:
        return record

    def meta(self, meta: dict) -> dict:
        return meta

    def weight(self, weight: float) -> float:
        return weight

    def contribution(self, values: torch.Tensor) -> torch.Tensor:
        """Our elements of a chunk, after our own finite check, before encoding."""
        return values

    def average(self, values: torch.Tensor) -> torch.Tensor:
        """A chunk of the average of the part we own, before it is encoded and sent."""
        return values

    def state(self, name: str, data: bytes) -> bytes:
        """Bytes of a state tensor we serve to a newcomer."""
        return data

    def start(self, flood) -> Optional[asyncio.Task]:
        """Called once on the network loop with `flood(group_id)`, a coroutine opening one stream."""
        return None


class Attacker(Hooks):
    def __init__(self, kinds: list[str]):
        unknown = [k for k in kinds if k not in ATTACKS]
        if unknown:
            raise ValueError(f"unknown attack {unknown[0]!r}; known: {', '.join(ATTACKS)}")
        self.kinds = set(kinds)
        self._beats = 0
        logger.warning(f"this peer is HOSTILE (faults.hostile): {', '.join(sorted(self.kinds))}")

    def progress(self, record: dict) -> dict:
        if "forge-progress" not in self.kinds:
            return record
        self._beats += 1
        forged = dict(record, ready=True, inner_step=0, samples=10**9, samples_per_s=1e9, serves_state=True)
        return dict(forged, round=FORGED_ROUND) if self._beats % 2 == 0 else forged

    def meta(self, meta: dict) -> dict:
        return dict(meta, samples="lots", base=["not", "a", "hash"]) if "garbage-meta" in self.kinds else meta

    def weight(self, weight: float) -> float:
        return 1e30 if "weight" in self.kinds else weight

    def contribution(self, values: torch.Tensor) -> torch.Tensor:
        if "nan" in self.kinds:
            return torch.full_like(values, float("nan"))
        if "huge" in self.kinds:
            return values * 1e6
        return values

    def average(self, values: torch.Tensor) -> torch.Tensor:
        return values + 1.0 if "bad-part" in self.kinds else values

    def state(self, name: str, data: bytes) -> bytes:
        if "poison-state" not in self.kinds or not name.startswith("global."):
            return data
        return bytes(b ^ 0x01 for b in data)  # same shapes and dtypes, other values

    def start(self, flood) -> Optional[asyncio.Task]:
        if "flood" not in self.kinds:
            return None

        async def keep_flooding() -> None:
            while True:
                await asyncio.gather(*[flood(os.urandom(16)) for _ in range(32)], return_exceptions=True)
                await asyncio.sleep(0.5)
        return asyncio.ensure_future(keep_flooding())


def hooks_for(kinds: list[str]) -> Hooks:
    return Attacker(kinds) if kinds else Hooks()
