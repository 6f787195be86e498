"""`SwarmAverager`: the trainer's `Averager` over a hivemind DHT.

A background thread runs an asyncio loop that holds a P2P replica of the DHT's daemon, the all-reduce
handlers (allreduce.py) and a state server. The trainer's thread calls in with bounded waits:

- `average()`: matchmaking for the round (matchmaking.py), then the bit-identical all-reduce; on
  failure it retries with whoever is still alive and the ORIGINAL pseudo-gradient until
  `cfg.round_timeout`, after which the round is discarded (averaged=None) rather than half-averaged.
  A peer that meets nobody looks at the progress records: peers at a higher round -> `behind=True`
  (fetch the state); peers at this round -> keep looking; nobody -> it applies its own step ("alone").
- `publish_progress()`: a `ProgressRecord` under `{run_id}_progress`, expiring after
  `cfg.progress_expiration` so a dead peer stops being waited for. A heartbeat thread re-stores it every
  `cfg.progress_interval`, so a record that stopped changing is a dead peer's long before it expires.
- `finish()`: after the last round, serve the state while live peers are behind (`cfg.linger_time`).
- `offer_state()` serializes once (torch.save + sha256) and keeps the bytes in memory, so serving a
  newcomer never blocks a round; `fetch_state()` tries donors freshest first, each bounded by
  `cfg.state_timeout`, and refuses a state whose checksum, round or `validate()` fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import io
import logging
import os
import random
import signal
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional

import hivemind
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from swarm.averaging import Averager, RoundOutcome
from swarm.config import FaultsConfig, SwarmConfig
from swarm.net import schema
from swarm.net.allreduce import AllReduce, AllReduceFailed, AllReduceResult, part_bounds
from swarm.net.codec import NoneCodec, get_codec, join_from_wire, part_residual, quantized_mask, split_for_wire
from swarm.net.matchmaking import Group, Matchmaker, NoGroup

logger = logging.getLogger(__name__)

STATE_CHUNK_BYTES = 2**20


class OtherBase(Exception):
    """The group's majority holds other global parameters than ours; `donors` are its members."""

    def __init__(self, reason: str, donors: list[str]):
        super().__init__(reason)
        self.donors = donors


def _die_now() -> None:
    """Fault injection (`faults.kill_phase: allreduce`): SIGKILL this peer mid all-reduce, like a power cut."""
    logger.warning("fault injection: killing this peer (SIGKILL) inside the all-reduce")
    os.kill(os.getpid(), signal.SIGKILL)


class SwarmAverager(Averager):
    networked = True

    def __init__(self, cfg: SwarmConfig, dht: hivemind.DHT, fingerprint: str, peer_name: str,
                 faults: Optional[FaultsConfig] = None):
        self.cfg, self.dht, self.fingerprint, self.peer_name = cfg, dht, fingerprint, peer_name
        self.faults = faults or FaultsConfig()
        self.peer_id = str(dht.peer_id)
        self._codec = codec = get_codec(cfg.compression)
        self._state_handler = schema.handler_name(cfg.run_id, fingerprint, "state")
        self._offered: Optional[tuple[int, bytes, str]] = None  # (round, torch.save bytes, sha256 hex)
        self._last_progress: Optional[tuple] = None  # publish_progress arguments, re-sent by the heartbeat
        self._averaged_once = False  # until a first group, peers starting with us may not have a record yet
        self._dht_lock = threading.Lock()  # the trainer's thread and the heartbeat share the DHT's pipe
        self._stopping = threading.Event()
        # The averager forks a process: create it before our thread exists.
        self._matchmaker = Matchmaker(cfg, dht, fingerprint)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-net", daemon=True)
        self._thread.start()
        self._beat = threading.Thread(target=self._heartbeat, name="swarm-heartbeat", daemon=True)
        self._beat.start()
        try:
            self._p2p = self._call(dht.replicate_p2p(), cfg.bootstrap_timeout)
            self._allreduce = AllReduce(self._p2p, schema.handler_name(cfg.run_id, fingerprint, "ar"), codec,
                                        cfg.allreduce_timeout)
            # A lossy codec never touches small tensors (norms, biases: codec.FP32_BELOW): they travel through
            # a second, fp32 all-reduce run side by side in the same group.
            self._allreduce_fp32 = AllReduce(self._p2p, schema.handler_name(cfg.run_id, fingerprint, "ar32"),
                                             NoneCodec(), cfg.allreduce_timeout) if codec.lossy else None
            self._call(self._start_handlers(), cfg.bootstrap_timeout)
        except BaseException:
            self.close()
            raise

    def _call(self, coro, timeout: float):
        """Run `coro` on the network thread; wait at most `timeout` s (then cancel it and raise TimeoutError)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"network call did not finish within {timeout:g} s") from None

    async def _start_handlers(self) -> None:
        await self._allreduce.start()
        if self._allreduce_fp32 is not None:
            await self._allreduce_fp32.start()
        await self._p2p.add_protobuf_handler(self._state_handler, self._rpc_state, averaging_pb2.DownloadRequest,
                                             stream_output=True)

    # ---- averaging ------------------------------------------------------------------------------------

    def average(self, round: int, pseudo_grad: list[torch.Tensor], samples: int, base: str = "") -> RoundOutcome:
        start = time.monotonic()
        deadline = start + self.cfg.round_timeout
        shapes = [t.shape for t in pseudo_grad]
        flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in pseudo_grad])
        if not self._local_ok(flat, samples):
            return RoundOutcome(None, note="local pseudo-gradient or sample count is not finite; not sent")
        mask = quantized_mask(shapes, self._codec)
        flat_q, flat_32 = split_for_wire(pseudo_grad, mask)
        sent = received = 0
        reason = "round_timeout too short for one attempt"
        if self.faults.kill_phase == "allreduce" and self.faults.kill_round == round + 1:
            self._allreduce.on_pushed = _die_now
        if self._last_progress is None or self._last_progress[0] != round:  # announce: ready for this round
            self.publish_progress(round, 0, samples, 0.0, ready=True)
        # hivemind refuses a step whose timeout is shorter than its matchmaking time: stop before that.
        while (left := deadline - time.monotonic()) > self.cfg.matchmaking_time:
            try:
                group = self._matchmaker.form_group(
                    round, {"samples": int(samples), "numel": flat.numel(), "base": base},
                    timeout=min(left, 2 * self.cfg.matchmaking_time), expected=self._expected_group(round))
                group = self._on_majority_base(group, base)
            except OtherBase as e:
                return RoundOutcome(None, comm_s=time.monotonic() - start, behind=True, donors=e.donors,
                                    note=str(e))
            except NoGroup as e:
                reason = e.reason
                if e.alone:
                    ahead, here = self._swarm_position(round)
                    if ahead:
                        return RoundOutcome(None, comm_s=time.monotonic() - start, behind=True,
                                            note=f"behind: peers committed round {max(ahead)}, we are at {round}")
                    if not here:
                        return RoundOutcome([t.clone() for t in pseudo_grad], total_samples=samples,
                                            comm_s=time.monotonic() - start, note="alone")
                logger.info(f"round {round + 1}: {reason}; retrying")
                continue
            try:
                if any(m.get("numel") != flat.numel() for m in group.metas):
                    raise AllReduceFailed(f"groupmates average vectors of other sizes: "
                                          f"{[m.get('numel') for m in group.metas]}")
                results = self._call(self._run_allreduce(group.group_id, group.members, flat_q, flat_32,
                                                         float(samples)),
                                     self.cfg.allreduce_timeout + self.cfg.request_timeout)
            except (AllReduceFailed, TimeoutError) as e:
                reason = str(e)
                logger.warning(f"round {round + 1}: all-reduce in a group of {len(group.members)} failed: {e}; "
                               f"retrying")
                continue
            sent += sum(r.bytes_sent for r in results if r is not None)
            received += sum(r.bytes_received for r in results if r is not None)
            averaged = join_from_wire(*[r.tensor if r is not None else torch.empty(0) for r in results], shapes, mask)
            residual = None
            if self.cfg.error_feedback:  # what the owners of our parts received of them, minus what we meant
                lost = part_residual(self._codec, flat_q, part_bounds(flat_q.numel(), len(group.members)))
                residual = join_from_wire(lost, torch.zeros_like(flat_32), shapes, mask)
            self._averaged_once = True
            return RoundOutcome(averaged, group_size=len(group.members), residual=residual,
                                total_samples=sum(int(m.get("samples", 0)) for m in group.metas),
                                bytes_sent=sent, bytes_received=received, comm_s=time.monotonic() - start,
                                note=f"group of {len(group.members)}")
        return RoundOutcome(None, bytes_sent=sent, bytes_received=received, comm_s=time.monotonic() - start,
                            note=f"round {round + 1} discarded after {self.cfg.round_timeout:g} s "
                                 f"(swarm.round_timeout): {reason}")

    async def _run_allreduce(self, group_id: bytes, members: list[PeerID], flat_q: torch.Tensor,
                             flat_32: torch.Tensor, weight: float) -> list[Optional[AllReduceResult]]:
        """[codec all-reduce of flat_q, fp32 all-reduce of flat_32] side by side; None for an empty vector.
        The first failure cancels the other and is raised."""
        jobs = [(self._allreduce, flat_q), (self._allreduce_fp32, flat_32)]
        tasks = [asyncio.ensure_future(ar.run(group_id, members, flat, weight)) if ar is not None and flat.numel()
                 else None for ar, flat in jobs]
        try:
            live = [task for task in tasks if task is not None]
            if live:
                done, _ = await asyncio.wait(live, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()  # raises the first failure
            return [task.result() if task is not None else None for task in tasks]
        finally:
            for task in tasks:
                if task is not None:
                    task.cancel()

    def _on_majority_base(self, group: Group, base: str) -> Group:
        """Keep the members whose global parameters (`base` hash) are the group's majority; ties go to the
        larger hash, so every member picks the same subgroup. A member outside it raises OtherBase."""
        bases = [m.get("base") for m in group.metas]
        majority = max(set(bases), key=lambda b: (bases.count(b), str(b)))
        keep = [i for i, b in enumerate(bases) if b == majority]
        if base != majority:
            raise OtherBase(f"global parameters differ from {len(keep)} of {len(bases)} groupmates: "
                            f"taking their state", [str(group.members[i]) for i in keep])
        if len(keep) < len(bases):
            logger.warning(f"{len(bases) - len(keep)} groupmates hold other global parameters; "
                           f"averaging without them")
        if len(keep) == 1:
            raise NoGroup("no groupmate shares our global parameters", alone=True)
        return Group(group.group_id, [group.members[i] for i in keep], [group.metas[i] for i in keep])

    def _local_ok(self, flat: torch.Tensor, samples: int) -> bool:
        """Never send a non-finite pseudo-gradient: peers would reject it and the whole group's round fails."""
        return bool(torch.isfinite(flat).all()) and samples >= 0

    # ---- progress -------------------------------------------------------------------------------------

    def publish_progress(self, round: int, inner_step: int, samples: int, samples_per_s: float,
                         ready: bool = False) -> None:
        self._last_progress = (round, inner_step, samples, samples_per_s, ready)
        self._store_progress(warn=True)

    def _store_progress(self, warn: bool) -> None:
        with self._dht_lock:  # read, stamp and send in one go: a later store always carries later content
            round, inner_step, samples, samples_per_s, ready = self._last_progress
            now = get_dht_time()
            record = schema.ProgressRecord(
                peer_id=self.peer_id, name=self.peer_name, round=round, inner_step=inner_step, samples=samples,
                samples_per_s=float(samples_per_s), time=float(now), serves_state=self._offered is not None,
                ready=ready)
            future = self.dht.store(schema.progress_key(self.cfg.run_id), record.dict(), subkey=self.peer_id,
                                    expiration_time=now + self.cfg.progress_expiration, return_future=True)
        try:
            if not future.result(timeout=self.cfg.request_timeout) and warn:
                logger.warning("progress record was not stored (no DHT peer accepted it)")
        except concurrent.futures.TimeoutError:
            if warn:
                logger.warning(f"progress record not confirmed within {self.cfg.request_timeout:g} s")

    def _heartbeat(self) -> None:
        """Re-store our record every progress_interval whatever the trainer does (eval, a checkpoint, a long
        all-reduce): a live peer's record stays fresh, so one older than `_stale_after()` is a dead peer's."""
        while not self._stopping.wait(self.cfg.progress_interval):
            if self._last_progress is not None:
                self._store_progress(warn=False)

    def _stale_after(self) -> float:
        return 3 * self.cfg.progress_interval + 2 * self.cfg.request_timeout

    def peers(self, include_self: bool = False) -> list[schema.ProgressRecord]:
        """Live progress records of the other peers of this run (and ours, with `include_self`)."""
        with self._dht_lock:
            future = self.dht.get(schema.progress_key(self.cfg.run_id), latest=True, return_future=True)
        found = future.result()
        if found is None or not isinstance(found.value, dict):
            return []
        now, records = get_dht_time(), []
        for subkey, item in found.value.items():
            record = schema.parse_progress(item.value)
            if (record is not None and record.peer_id == subkey and item.expiration_time > now
                    and (include_self or subkey != self.peer_id)):
                records.append(record)
        return records

    def others_ready(self, round: int) -> bool:
        return any(r.round == round and r.ready for r in self.peers())

    def _swarm_position(self, round: int) -> tuple[list[int], list[str]]:
        """(rounds of live peers ahead of `round`, names of live peers at `round`).

        A read that misses our own fresh record failed (a DHT time-out looks like an empty swarm): then
        everyone counts as possibly here, so a peer never commits "alone" on a read it cannot trust.
        """
        records = self._trusted_records()
        if records is None:
            return [], ["(progress records unreadable)"]
        others = [r for r in records if r.peer_id != self.peer_id]
        return [r.round for r in others if r.round > round], [r.name for r in others if r.round == round]

    def _expected_group(self, round: int) -> Optional[int]:
        """Live peers that may average `round`, us included: those at it, and those whose record still shows
        the round before (not reported since they committed it, or still averaging it). None (wait the full
        matchmaking_time) before this peer's first group, when peers started with it may have no record yet,
        and on an unreadable read."""
        records = self._trusted_records() if self._averaged_once else None
        return None if records is None else sum(1 for r in records if r.round in (round - 1, round))

    def _trusted_records(self) -> Optional[list[schema.ProgressRecord]]:
        """All live records, ours included; None when the read misses our own fresh record (it failed)."""
        records = self.peers(include_self=True)
        return records if any(r.peer_id == self.peer_id for r in records) else None

    # ---- state ----------------------------------------------------------------------------------------

    def offer_state(self, round: int, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        blob = buffer.getvalue()
        self._offered = (round, blob, hashlib.sha256(blob).hexdigest())

    async def _rpc_state(self, request: averaging_pb2.DownloadRequest,
                         context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        offered = self._offered  # one atomic read: a new offer does not disturb a download in progress
        if offered is None:
            yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(None))
            return
        round, blob, digest = offered
        meta = MSGPackSerializer.dumps({"round": round, "size": len(blob), "sha256": digest})
        yield averaging_pb2.DownloadData(metadata=meta)
        for start in range(0, len(blob), STATE_CHUNK_BYTES):
            chunk = runtime_pb2.Tensor(buffer=blob[start:start + STATE_CHUNK_BYTES])
            yield averaging_pb2.DownloadData(tensor_part=chunk)

    async def _download(self, peer: PeerID) -> tuple[dict, bytes]:
        stream = await self._p2p.iterate_protobuf_handler(peer, self._state_handler, averaging_pb2.DownloadRequest(),
                                                          averaging_pb2.DownloadData)
        meta, chunks, size = None, [], 0
        async for message in stream:
            if meta is None:
                meta = MSGPackSerializer.loads(message.metadata)
                if not isinstance(meta, dict):
                    raise ValueError("the donor offers no state")
                continue
            chunks.append(message.tensor_part.buffer)
            size += len(message.tensor_part.buffer)
            if size > meta["size"]:
                raise ValueError(f"the donor sent more than the announced {meta['size']} bytes")
        if meta is None:
            raise ValueError("the donor sent nothing")
        return meta, b"".join(chunks)

    def fetch_state(self, newer_than: int, validate: Callable[[dict], None],
                    donors: Optional[list[str]] = None) -> Optional[dict[str, Any]]:
        donors = [r for r in self.peers() if r.round > newer_than and r.serves_state
                  and (donors is None or r.peer_id in donors)]
        donors.sort(key=lambda r: (-r.round, random.random()))  # freshest first; spread newcomers over ties
        for donor in donors:
            try:
                meta, blob = self._call(self._download(PeerID.from_base58(donor.peer_id)), self.cfg.state_timeout)
                if len(blob) != meta["size"] or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
                    raise ValueError("checksum mismatch")
                if not meta["round"] > newer_than:
                    raise ValueError(f"it offers round {meta['round']}, not newer than {newer_than}")
                state = torch.load(io.BytesIO(blob), weights_only=True)
                if not isinstance(state, dict):
                    raise ValueError(f"state is a {type(state).__name__}, not a dict")
                validate(state)
            except Exception as e:  # any failure of one donor (network, checksum, unpickling, validate): next donor
                logger.warning(f"state from {donor.name} ({donor.peer_id}) refused: {e!r}")
                continue
            logger.info(f"fetched the state of round {meta['round']} from {donor.name}")
            return state
        return None

    # ---- shutdown -------------------------------------------------------------------------------------

    def finish(self, round: int) -> None:
        """Serve the final state while live peers are at earlier rounds, at most `cfg.linger_time` s.

        A peer that fell behind in the last rounds (a failed all-reduce, a slow machine) learns it only
        after its next matchmaking; if every peer ahead has left by then it finds no donor and ends on its
        own stale parameters. Peers that finished announce it (a record at their final round), so in a
        swarm where nobody is behind this returns at once.
        """
        self.publish_progress(round, 0, 0, 0.0)
        deadline, waiting_for = time.monotonic() + self.cfg.linger_time, None
        while time.monotonic() < deadline:
            fresh = get_dht_time() - self._stale_after()  # a dead peer's record lingers until it expires
            behind = sorted(r.name for r in self.peers() if r.round < round and r.time > fresh)
            if not behind:
                return
            if behind != waiting_for:
                logger.info(f"finished at round {round}; serving the state to peers still behind: {behind}")
                waiting_for = behind
            time.sleep(max(0.0, min(self.cfg.progress_interval, 1.0, deadline - time.monotonic())))  # poll
        logger.warning(f"stopped serving the state after {self.cfg.linger_time:g} s (swarm.linger_time); "
                       f"still behind: {waiting_for}")

    async def _stop_handlers(self) -> None:
        if hasattr(self, "_allreduce"):
            await self._allreduce.stop()
            if self._allreduce_fp32 is not None:
                await self._allreduce_fp32.stop()
            await self._p2p.remove_protobuf_handler(self._state_handler, stream_output=True)
        if hasattr(self, "_p2p"):
            await self._p2p.shutdown()  # a replica: closes our client, the DHT's daemon keeps running

    async def _drain(self) -> None:
        for allreduce in (getattr(self, "_allreduce", None), getattr(self, "_allreduce_fp32", None)):
            if allreduce is not None and (pending := await allreduce.drain()):
                logger.warning(f"leaving with {len(pending)} all-reduce(s) not fetched by every groupmate")

    def close(self) -> None:
        self._stopping.set()
        self._beat.join(self.cfg.request_timeout + self.cfg.progress_interval)
        if self._thread.is_alive():
            try:  # serve our last parts to groupmates still fetching them, then stop
                self._call(self._drain(), 2 * self.cfg.allreduce_timeout + self.cfg.request_timeout)
            except Exception as e:  # the daemon may be gone already; shutting down anyway
                logger.warning(f"serving the last all-reduce before leaving failed: {e!r}")
            try:
                self._call(self._stop_handlers(), self.cfg.request_timeout)
            except Exception as e:  # the daemon may be gone already; shutting down anyway
                logger.warning(f"closing the network handlers failed: {e!r}")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(self.cfg.request_timeout)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        self._matchmaker.close()
