"""Hostile peers for demos and tests: the attacks a public swarm must survive (`faults.hostile`, and
`swarm local --hostile KIND@PEER`).

The protocol code calls a `Hooks` object at a few points where a peer's own behaviour could be altered
(the records it publishes, its matchmaking metadata, its weight, its encoded contribution, the average it
returns as a part owner, the state it serves); honest peers use the do-nothing `Hooks`. `Attacker` turns
those hooks against the swarm, one named attack each, like torchft's `EventInjector`: the attack lives here,
never as `if hostile:` branches inside the protocol. What catches each attack is listed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from swarm.config import ATTACKS
from swarm.net.allreduce.hooks import AllReduceHooks
from swarm.net.wire import CONTROL_BYTES, HEADER, Channel, Kind, WireError

logger = logging.getLogger(__name__)

FORGED_OUTER_STEP = 2**40
CLAIMED_SAMPLES = 10**18
FLOOD_STREAMS = 32
TRICKLE_STREAMS = 32  # per handler of every other peer, held open a byte per half stall
SYBILS, SYBIL_BUDGET_S = 16, 60.0  # identities the sybil mints, and the seconds it spends minting them
QUORUM_SYBILS = 8  # identities sybil-quorum mints: more than the honest peers of the tests and the hostile bench


@dataclass
class Reach:
    """What a hostile peer's background attacks (`Hooks.run`) can reach: its P2P, the swarm's stream names
    (`handler("ar")`, `handler("state")`), the stall time-out, the other peers (`others()`, blocking), and the
    DHT with the run's settings."""

    p2p: P2P
    handler: Callable[[str], str]
    stall: float
    others: Callable[[], list[str]]
    dht: Any = None
    cfg: Any = None  # the SwarmConfig


class Hooks(AllReduceHooks):
    """A peer's own behaviour at the protocol's hook points (the all-reduce's among them); this base class
    changes nothing."""

    def progress(self, record: dict) -> dict:
        return record

    def commit(self, record: dict) -> dict:
        """A commit record, before it is stored."""
        return record

    def meta(self, meta: dict) -> dict:
        return meta

    def lead(self, message):
        """As a matchmaking leader, the group we hand every follower (hivemind's BEGIN_ALLREDUCE
        `MessageFromLeader`: the members and their metas), before it is sent; runs in the averager's process."""
        return message

    def weight(self, weight: float) -> float:
        return weight

    def matchmaking_time(self, seconds: float) -> float:
        """How long we wait in matchmaking (swarm.matchmaking_time): hivemind's peers join the one whose wait
        ends first, so a shorter wait makes us their leader."""
        return seconds

    def manifest(self, manifest: dict) -> dict:
        """The manifest of the state we serve to a newcomer (outer step, sha256, meta, and per tensor
        [name, dtype, shape, bytes]), before it is sent."""
        return manifest

    def state(self, name: str, data: bytes) -> bytes:
        """Bytes of a state tensor we serve to a newcomer."""
        return data

    async def run(self, reach: Reach) -> None:
        """Runs on the network loop for the peer's lifetime."""


class Attacker(Hooks):
    def __init__(self, kinds: list[str]):
        unknown = [k for k in kinds if k not in ATTACKS]
        if unknown:
            raise ValueError(f"unknown attack {unknown[0]!r}; known: {', '.join(ATTACKS)}")
        self.kinds = set(kinds)
        self._beats = 0
        self._published: Optional[dict] = None  # our last progress record as we made it (sybil-quorum)
        self._seen: dict[bytes, bytes] = {}  # member -> the last meta it signed for a group we led (replay)
        self._led: dict[bytes, Any] = {}  # the last group we led -> the message we hand its followers
        logger.warning(f"this peer is HOSTILE (faults.hostile): {', '.join(sorted(self.kinds))}")

    def progress(self, record: dict) -> dict:
        self._published = record
        if "claim-ahead" in self.kinds and record.get("sha256"):
            return dict(record, round=record["round"] + 1, serves_state=True)
        if "forge-progress" not in self.kinds:
            return record
        self._beats += 1
        forged = dict(record, ready=True, inner_step=0, samples=10**9, samples_per_s=1e9, serves_state=True)
        return dict(forged, round=FORGED_OUTER_STEP) if self._beats % 2 == 0 else forged

    def commit(self, record: dict) -> dict:
        if "forged-commit" not in self.kinds:
            return record
        return dict(record, round=record["round"] + 1, sha256=hashlib.sha256(record["sha256"].encode()).hexdigest())

    def meta(self, meta: dict) -> dict:
        if "garbage-meta" in self.kinds:
            return dict(meta, samples="lots", base=["not", "a", "hash"])
        if "stall-round" in self.kinds:
            return dict(meta, round=FORGED_OUTER_STEP)
        if "stall-numel" in self.kinds:
            return dict(meta, numel=meta.get("numel", 0) + 1)
        if "stall-token" in self.kinds:  # the barrier's tensor holds another token than this
            return dict(meta, token=1.0)
        return dict(meta, samples=CLAIMED_SAMPLES) if "weight" in self.kinds else meta

    def weight(self, weight: float) -> float:
        return float(CLAIMED_SAMPLES) if "weight" in self.kinds else weight

    def matchmaking_time(self, seconds: float) -> float:
        """frame, replay: lead the groups (a third of the others' wait)."""
        return seconds / 3 if self.kinds & {"frame", "replay"} else seconds

    def lead(self, message):
        """frame: every member's meta, as we hand it on, says `samples: "lots"` (malformed): followers that
        trusted the leader's word would charge each other offenses, and ban each other after two.
        replay: every member's meta is the one it signed for an earlier group we led, once we have one (each
        signature verifies): followers that trusted a valid signature would charge that member "metadata of
        another outer step", and ban it after two."""
        if "frame" not in self.kinds and "replay" not in self.kinds:
            return message
        if message.group_id in self._led:  # this runs once per follower: each gets the group's one message
            return self._led[message.group_id]
        forged = []
        for peer, entry in zip(message.ordered_peer_ids, message.gathered):
            bandwidth, mode, user = MSGPackSerializer.loads(entry)
            if "frame" in self.kinds:
                user = MSGPackSerializer.dumps(dict(MSGPackSerializer.loads(user), samples="lots"))
            else:
                user, self._seen[peer] = self._seen.get(peer, user), user
            forged.append(MSGPackSerializer.dumps([bandwidth, mode, user]))
        self._led = {message.group_id: averaging_pb2.MessageFromLeader(
            code=message.code, group_id=message.group_id, ordered_peer_ids=message.ordered_peer_ids, gathered=forged)}
        return self._led[message.group_id]

    def contribution(self, values: torch.Tensor) -> torch.Tensor:
        if "nan" in self.kinds:
            return torch.full_like(values, float("nan"))
        if "huge" in self.kinds:
            return values * 1e6
        return values

    def audited(self, payload: bytes) -> bytes:
        if "audit-lie" not in self.kinds or not payload:
            return payload
        return bytes([payload[0] ^ 0xFF]) + bytes(payload[1:])

    def average(self, values: torch.Tensor, chunk: int) -> torch.Tensor:
        return values + 1.0 if "bad-part" in self.kinds else values

    async def push(self, group, j: int, channel: Channel, push) -> None:
        """stall-silent: push all but the last chunk of each part (none of a part of one chunk), then hold the
        stream open and send nothing more."""
        if "stall-silent" not in self.kinds:
            return await push(None)
        await push(-1)
        await asyncio.Event().wait()  # until the group is over here (cancelled)

    def result(self, group, i: int, k: int, payload: bytes) -> bytes:
        """lying-owner: the first member after us in the group gets other bytes of our part's average (the lowest
        bit of its first byte flipped: still well-formed, still finite) than the others; its digest, signed, is
        of what it got."""
        if "lying-owner" not in self.kinds or i != (group.me + 1) % len(group.members) or not payload:
            return payload
        return bytes([payload[0] ^ 1]) + bytes(payload[1:])

    def state(self, name: str, data: bytes) -> bytes:
        if "poison-state" in self.kinds and name.startswith("global."):
            return bytes(b ^ 0x01 for b in data)  # same shapes and dtypes, other values
        if "poison-momentum" in self.kinds and name.startswith("momentum."):
            return poisoned_momentum(data)
        return data

    async def run(self, reach: Reach) -> None:
        await asyncio.gather(*[attack(reach) for kind, attack in (("flood", self._flood), ("trickle", self._trickle),
                                                                   ("sybil", self._sybil),
                                                                   ("sybil-quorum", self._sybil_quorum))
                               if kind in self.kinds])

    async def _flood(self, reach: Reach) -> None:
        """flood: every second, open FLOOD_STREAMS all-reduce streams to every other peer, each naming a
        made-up group, and hold them open (an owner waits `stall` s for a group it does not know yet)."""
        p2p, handler, others = reach.p2p, reach.handler("ar"), reach.others
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

    async def _trickle(self, reach: Reach) -> None:
        """trickle: keep TRICKLE_STREAMS streams open on each stream handler of every other peer, each
        announcing the largest HELLO anyone accepts and then sending one byte of it every stall / 2 s, so that
        no stall time-out ever fires; a stream the victim ends is opened again."""
        held: dict[tuple[str, str], set[asyncio.Task]] = {}

        async def hold(peer: str, name: str) -> None:
            with contextlib.suppress(WireError, ConnectionError, RuntimeError):
                channel = await Channel.open(reach.p2p, PeerID.from_base58(peer), name, reach.stall)
                try:
                    channel.writer.write(HEADER.pack(Kind.HELLO, CONTROL_BYTES))
                    while True:
                        await channel.writer.drain()
                        try:
                            async with asyncio.timeout(reach.stall / 2):
                                while await channel.reader.read(2**16):  # the victim's FAIL, discarded
                                    pass
                            return  # the victim closed the stream
                        except TimeoutError:
                            channel.writer.write(b"\x00")
                finally:
                    channel.close()
        while True:
            targets = await asyncio.get_running_loop().run_in_executor(None, reach.others)
            for peer in targets:
                for name in (reach.handler(w) for w in ("ar", "ar_repair", "ar_audit", "state")):
                    tasks = held.setdefault((peer, name), set())
                    tasks -= {t for t in tasks if t.done()}
                    tasks |= {asyncio.ensure_future(hold(peer, name)) for _ in range(TRICKLE_STREAMS - len(tasks))}
            await asyncio.sleep(1.0)

    async def _sybil(self, reach: Reach) -> None:
        """sybil: mint SYBILS identities (with the swarm's proof of work each, within SYBIL_BUDGET_S s) and have
        each sign the run's fingerprint and manifest for a forged run: the run's own config with outer.lr x 10,
        under that config's fingerprint. A peer that checks the fingerprint or reads the manifest later (a
        newcomer, `swarm join`) then counts them as peers of the run."""
        await asyncio.get_running_loop().run_in_executor(None, sybil_attack, reach.dht, reach.cfg)


    async def _sybil_quorum(self, reach: Reach) -> None:
        """sybil-quorum: mint QUORUM_SYBILS identities (free, or with the swarm's proof of work), then every
        progress interval have each sign a progress record one outer step past ours, on a perturbed hash of ours,
        serving it, and a commit record of that outer step: more voters than the honest peers, for a state that does
        not exist. From the run's second outer step: at the first, nothing is known of anyone, and identities count."""
        from hivemind.utils.timed_storage import get_dht_time

        from swarm.net import schema
        from swarm.net.identity import owner_peer_id
        from swarm.net.sybil import mint, store_as

        loop, cfg = asyncio.get_running_loop(), reach.cfg
        sybils, _ = await loop.run_in_executor(None, mint, QUORUM_SYBILS, cfg.identity_work, SYBIL_BUDGET_S)
        logger.warning(f"sybil-quorum: {len(sybils)} identities minted: "
                       f"{', '.join(str(owner_peer_id(s.owner)) for s in sybils)}")
        while True:
            await asyncio.sleep(cfg.progress_interval)
            ours = self._published
            if ours is None or ours["round"] < 1 or not ours.get("sha256"):
                continue
            now, ahead = get_dht_time(), ours["round"] + 1
            perturbed = hashlib.sha256(f"sybil-quorum {ours['sha256']}".encode()).hexdigest()
            for i, sybil in enumerate(sybils):
                progress = schema.ProgressRecord(
                    peer_id=owner_peer_id(sybil.owner), name=f"sybil-{i}", round=ahead, inner_step=0, samples=0,
                    samples_per_s=0.0, time=now, serves_state=True, sha256=perturbed, work=sybil.work)
                commit = schema.CommitRecord(name=f"sybil-{i}", round=ahead, sha256=perturbed, time=now,
                                             work=sybil.work)
                for key, record, expiration in (
                        (schema.progress_key(cfg.run_id), progress, cfg.progress_expiration),
                        (schema.commits_key(cfg.run_id), commit, schema.RUN_RECORD_EXPIRATION)):
                    await loop.run_in_executor(None, store_as, reach.dht, sybil, key, record.dict(),
                                               now + expiration, cfg.request_timeout)


def sybil_attack(dht, cfg, budget_s: float = SYBIL_BUDGET_S, count: int = SYBILS) -> Optional[dict]:
    """The `sybil` attack, blocking: waits for the run's manifest, mints identities, stores their votes.
    Returns what it did (identities, seconds per identity, the forged fingerprint), also logged."""
    from hivemind.utils.timed_storage import get_dht_time

    from swarm.net import schema
    from swarm.net.manifest import ManifestRefused, choose_manifest, read_manifests
    from swarm.net.sybil import forged_run, mint, store_as

    deadline = time.monotonic() + budget_s
    while True:
        try:
            fingerprint, manifests = read_manifests(dht, cfg.run_id, cfg.request_timeout, cfg.identity_work)
            choice = choose_manifest(cfg.run_id, manifests, fingerprint)
            break
        except (ManifestRefused, TimeoutError):
            if time.monotonic() > deadline:
                logger.warning("sybil: the run has no manifest to forge; giving up")
                return None
            time.sleep(1.0)
    forged, forged_fp = forged_run(choice.shared, choice.record.corpus_sha256, choice.record.weights_sha256)
    sybils, per_identity = mint(count, cfg.identity_work, max(1.0, deadline - time.monotonic()))
    for sybil in sybils:
        now = get_dht_time()
        for key, record in ((schema.run_key(cfg.run_id), schema.RunRecord(fingerprint=forged_fp, time=now,
                                                                          work=sybil.work)),
                            (schema.manifest_key(cfg.run_id), schema.ManifestRecord(
                                config=forged, fingerprint=forged_fp, creator=choice.record.creator, time=now,
                                version=schema.MANIFEST_VERSION, corpus_sha256=choice.record.corpus_sha256,
                                weights_sha256=choice.record.weights_sha256, work=sybil.work))):
            store_as(dht, sybil, key, record.dict(), now + schema.RUN_RECORD_EXPIRATION, cfg.request_timeout)
    logger.warning(f"sybil: {len(sybils)} identities signed fingerprint {forged_fp} (outer.lr x 10), "
                   f"{per_identity:.2f} s each to mint with swarm.identity_work {cfg.identity_work}")
    return {"identities": len(sybils), "s_per_identity": per_identity, "fingerprint": forged_fp}


def poisoned_momentum(data: bytes) -> bytes:
    """poison-momentum: fp32 momentum bytes (a whole number of values: DATA frames are cut at 2^20 bytes) made -10x
    themselves, so that a taker's next outer steps would run the other way, far."""
    return (torch.frombuffer(bytearray(data), dtype=torch.float32) * -10.0).numpy().tobytes()


def hooks_for(kinds: list[str]) -> Hooks:
    return Attacker(kinds) if kinds else Hooks()
