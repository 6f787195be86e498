"""Newcomers download a peer's state tensor by tensor, straight into their own tensors.

A donor serves its latest `Snapshot` (the live tensors of its last committed outer step, `state.py` names) over
one stream: a MANIFEST (outer steps, the state's hash, schedule position, and every tensor's name, dtype, shape
and byte count), then each tensor's bytes in DATA frames of at most `DATA_BYTES`. Nothing is serialized into one
blob on either side, and nothing is copied to serve it: global parameters and outer momentum do not change until
the donor's next outer step, and it reads them under its `DiLoCo.version` seqlock: if it commits again (or
starts loading a state) mid-download, it stops with FAIL and the newcomer tries again. A served state holds
nothing else: a donor's AdamW moments are its own (swarm/state/statehash.py says why a taker starts its inner
optimizer afresh).

The receiver checks before it writes a byte: the outer steps and hash must be what the swarm committed
(`check`, from the DHT records, not from the donor), and every tensor must be one it expects, by name,
dtype, shape and byte count (`Intake.destinations`). Each DATA frame may hold no more than the rest of
its tensor, so no donor can make it buffer more than one frame; bytes are written in place on the
receiver's own device. After the last byte the state must hash to the announced hash (swarm/state/statehash.py: the
global parameters, the outer momentum and the rounds closed of the manifest's `meta`), or it is `StateForged`:
a donor that changed any of them under its committed hash is refused and charged. Any refusal raises
`StateRefused` naming the reason; the caller then tries the next donor. A failed download leaves the
receiver's state overwritten in part: the caller (catch-up) never trains on it, it takes another donor's
state or stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import time
from typing import Callable, Optional

import torch
from hivemind.p2p import P2P, PeerID

from swarm.errors import SwarmError
from swarm.net.access import Access
from swarm.net.budget import transfer_deadline
from swarm.net.hostile import Hooks
from swarm.net.wire import FIRST_FRAME_STALLS, Channel, Kind, ProtocolError, serve
from swarm.state.peerstate import TensorSpec
from swarm.state.statehash import covers, state_sha256
from swarm.tensors import byte_view
from swarm.train.averaging import Download, Intake, Snapshot

logger = logging.getLogger(__name__)

DATA_BYTES = 2**20
MAX_DOWNLOADS = 4  # concurrent downloads one donor serves; more are told to try another donor


class StateRefused(SwarmError):
    """A donor's state does not fit, is not what the swarm committed, or did not arrive whole."""


class StateForged(StateRefused):
    """The donor's bytes do not hash to the committed hash it announced: no honest donor sends that."""


class Moved(SwarmError):
    """The donor's state changed under a download (it committed again, or is loading a state)."""


class StateServer:
    def __init__(self, p2p: P2P, name: str, stall: float, pool: concurrent.futures.Executor,
                 access: Optional[Access] = None, hooks: Optional[Hooks] = None):
        self.p2p, self.name, self.stall, self.pool = p2p, name, stall, pool
        self.access, self.hooks = access or Access(), hooks or Hooks()
        self.snapshot: Optional[Snapshot] = None
        self._busy = 0

    async def start(self) -> None:
        await serve(self.p2p, self.name, self.stall, lambda channel: self._serve(channel), self.access)

    async def stop(self) -> None:
        await self.p2p.remove_binary_stream_handler(self.name)

    @staticmethod
    def _read(snapshot: Snapshot, tensor: torch.Tensor, start: int, end: int, committed: bool) -> bytes:
        """Bytes [start, end) of `tensor`; for the committed tensors, Moved if the outer step changed meanwhile."""
        if committed and snapshot.current_version() != snapshot.version:
            raise Moved("this peer's state changed (a new outer step was committed or a state is loading)")
        data = byte_view(tensor)[start:end].cpu().numpy().tobytes()
        if committed and snapshot.current_version() != snapshot.version:
            raise Moved("this peer's state changed (a new outer step was committed or a state is loading)")
        return data

    async def _serve(self, channel: Channel) -> None:
        await channel.recv_control()  # `serve` refused the peers `access` refuses before this read
        snapshot = self.snapshot
        if snapshot is None or snapshot.current_version() != snapshot.version:
            return await channel.refuse("no state to serve right now")
        if self._busy >= MAX_DOWNLOADS:
            return await channel.refuse(f"serving {self._busy} downloads already; try another donor")
        self._busy += 1
        try:
            specs = [TensorSpec.of(name, t) for name, t in snapshot.tensors.items()]
            await channel.send_control(Kind.MANIFEST, self.hooks.manifest({
                "round": snapshot.outer_step, "sha256": snapshot.sha256, "meta": snapshot.meta,
                "tensors": [[*s.to_list(), s.nbytes] for s in specs]}))
            loop = asyncio.get_running_loop()
            for spec, tensor in zip(specs, snapshot.tensors.values()):
                for start in range(0, spec.nbytes, DATA_BYTES):
                    end = min(start + DATA_BYTES, spec.nbytes)
                    data = await loop.run_in_executor(self.pool, self._read, snapshot, tensor, start, end,
                                                      covers(spec.name))
                    await channel.send(Kind.DATA, self.hooks.state(spec.name, data))
        except Moved as e:
            await channel.fail(str(e))
        finally:
            self._busy -= 1


def _manifest(value: dict) -> tuple[int, str, dict, list[TensorSpec]]:
    """(outer step, sha256, meta, specs) of a donor's manifest; StateRefused if anything is malformed."""
    outer_step, sha, meta, entries = (value.get(k) for k in ("round", "sha256", "meta", "tensors"))
    if not (isinstance(outer_step, int) and outer_step >= 0 and isinstance(sha, str) and isinstance(meta, dict)
            and type(meta.get("round")) is int and isinstance(entries, list)):
        raise StateRefused("malformed manifest")
    specs = []
    for entry in entries:
        try:
            spec = TensorSpec.from_list(entry[:3] if isinstance(entry, list) else entry)
            if len(entry) != 4 or entry[3] != spec.nbytes:
                raise ValueError(f"{spec.name}: {entry[3] if len(entry) == 4 else '?'} bytes announced for "
                                 f"{spec.dtype} {list(spec.shape)} ({spec.nbytes} bytes)")
        except (ValueError, TypeError) as e:
            raise StateRefused(f"manifest entry refused: {e}") from None
        specs.append(spec)
    return outer_step, sha, meta, specs


async def download(p2p: P2P, peer: PeerID, name: str, stall: float, min_bandwidth: float, intake: Intake,
                   check: Callable[[int, str], Optional[str]], pool: concurrent.futures.Executor) -> Download:
    """Take `peer`'s state into `intake`. `check(outer_step, sha256)` returns why a state of that outer step and hash
    must not be taken (None: take it); it runs in `pool`, since it may block (DHT reads). Raises StateRefused
    or a WireError."""
    start = time.monotonic()
    channel = await Channel.open(p2p, peer, name, stall)
    try:
        await channel.send_control(Kind.HELLO, {})
        loop = asyncio.get_running_loop()
        channel.deadline = loop.time() + FIRST_FRAME_STALLS * stall  # a donor must not trickle its manifest
        outer_step, sha, meta, specs = _manifest(await channel.recv_control())
        reason = await loop.run_in_executor(pool, check, outer_step, sha)  # it may read the DHT: not on this loop
        if reason is not None:
            raise StateRefused(f"outer step {outer_step} hash {sha[:12]}: {reason}")
        try:
            targets = intake.destinations(specs)
        except ValueError as e:
            raise StateRefused(f"it does not fit this model: {e}") from None
        total = sum(s.nbytes for s in specs)
        digest = hashlib.sha256()

        def write(spec: TensorSpec, start: int, payload: bytearray) -> None:
            data = torch.frombuffer(payload, dtype=torch.uint8)
            byte_view(targets[spec.name])[start:start + len(payload)].copy_(data)
            if covers(spec.name):
                digest.update(payload)

        try:
            async with asyncio.timeout(transfer_deadline(total, stall, min_bandwidth)):
                for spec in specs:
                    got = 0
                    while got < spec.nbytes:
                        payload = await channel.recv_kind(Kind.DATA, min(DATA_BYTES, spec.nbytes - got))
                        if not payload:
                            raise ProtocolError(f"{peer} sent an empty frame")
                        await loop.run_in_executor(pool, write, spec, got, payload)
                        got += len(payload)
        except TimeoutError:
            raise StateRefused(f"{total} bytes not done within {transfer_deadline(total, stall, min_bandwidth):.0f} s "
                               f"(swarm.min_bandwidth)") from None
        got_sha = state_sha256(digest.hexdigest(), meta.get("round"))
        if got_sha != sha:
            raise StateForged(f"its global parameters, outer momentum and rounds closed hash to {got_sha[:12]}, not "
                              f"the announced {sha[:12]}")
        try:
            intake.accept(meta, outer_step)
        except ValueError as e:
            raise StateRefused(str(e)) from None
        return Download(outer_step, str(peer), channel.traffic.received, time.monotonic() - start, got_sha)
    finally:
        channel.close()
