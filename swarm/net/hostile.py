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
from typing import Callable

import torch
from hivemind.p2p import P2P, PeerID

from swarm.net.attacks import ATTACKS
from swarm.net.wire import Channel, Kind

logger = logging.getLogger(__name__)

FORGED_ROUND = 2**40
CLAIMED_SAMPLES = 10**18
FLOOD_STREAMS = 32


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

    def average(self, values: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunk `chunk` (its index in our part) of the average of the part we own, before it is encoded and
        sent."""
        return values

    def state(self, name: str, data: bytes) -> bytes:
        """Bytes of a state tensor we serve to a newcomer."""
        return data

    async def run(self, p2p: P2P, handler: str, others: Callable[[], list[str]]) -> None:
        """Runs on the network loop for the peer's lifetime; `others()` (blocking) lists the other peers."""


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
        if "garbage-meta" in self.kinds:
            return dict(meta, samples="lots", base=["not", "a", "hash"])
        return dict(meta, samples=CLAIMED_SAMPLES) if "weight" in self.kinds else meta

    def weight(self, weight: float) -> float:
        return float(CLAIMED_SAMPLES) if "weight" in self.kinds else weight

    def contribution(self, values: torch.Tensor) -> torch.Tensor:
        if "nan" in self.kinds:
            return torch.full_like(values, float("nan"))
        if "huge" in self.kinds:
            return values * 1e6
        return values

    def average(self, values: torch.Tensor, chunk: int) -> torch.Tensor:
        return values + 1.0 if "bad-part" in self.kinds else values

    def state(self, name: str, data: bytes) -> bytes:
        if "poison-state" not in self.kinds or not name.startswith("global."):
            return data
        return bytes(b ^ 0x01 for b in data)  # same shapes and dtypes, other values

    async def run(self, p2p: P2P, handler: str, others: Callable[[], list[str]]) -> None:
        """flood: every second, open FLOOD_STREAMS all-reduce streams to every other peer, each naming a
        made-up group, and hold them open (an owner waits `stall` s for a group it does not know yet)."""
        if "flood" not in self.kinds:
            return
        held: list[Channel] = []

        async def open_one(peer: PeerID) -> None:
            channel = await Channel.open(p2p, peer, handler, 5.0)
            await channel.send_control(Kind.HELLO, {"group": os.urandom(16), "weight": 1.0})
            held.append(channel)
        while True:
            targets = await asyncio.get_running_loop().run_in_executor(None, others)
            await asyncio.gather(*[open_one(PeerID.from_base58(p)) for p in targets for _ in range(FLOOD_STREAMS)],
                                 return_exceptions=True)
            while len(held) > 4 * FLOOD_STREAMS * max(1, len(targets)):
                held.pop(0).close()
            await asyncio.sleep(1.0)


def hooks_for(kinds: list[str]) -> Hooks:
    return Attacker(kinds) if kinds else Hooks()
