"""`SwarmAverager`: the trainer's `Averager` over a hivemind DHT.

A background thread runs an asyncio loop that holds a P2P replica of the DHT's daemon, the all-reduce
(allreduce/) and the state server (statesync.py); a thread pool does their CPU work. The trainer's thread
calls in with bounded waits:

- `average()`: each attempt goes through four stages until one settles the outer step or its deadline
  (`budget.outer_step_deadline`, from the vector's bytes) passes, when it is discarded (averaged=None), never
  half-averaged: *assess* where this peer stands by the records (`policy.assess`: behind the swarm or on a
  minority's parameters -> `behind=True`, take the state), *form a group* (matchmaking.py, less known
  offenders), *reduce* (the streamed all-reduce into the trainer's buffers), *decide* (the outcome). A peer
  that meets nobody and that the records show alone applies its own step; once it has averaged with others,
  it does so without matchmaking when the records show nobody else live at its outer step or the one before
  (until its first group, peers starting with it may not have a record yet).
- `publish_progress()`, `round_over()`, `offer_state()`: this peer's signed progress and commit records and
  the others' (`records`: records.py); a state is served to newcomers once its commit is recorded.
- `fetch_state()`: take the swarm's state from the donors the policy names, verified against the hash the
  swarm committed; SwarmError if the swarm is ahead and no donor can give it within the live window plus
  `stall_timeout`.
- `finish()`: after the last outer step, serve the state while live peers are behind (linger.py).

Methods take the trainer's `outer_step` (its count of committed outer steps, swarm/train/averaging.py); records,
commits, state offers and downloads follow each one.

A client (`swarm.client_mode`: a peer that cannot be dialed, e.g. behind a NAT) owns no part of the
all-reduce (it pushes to the owners and takes the averages back on its own streams), records its commits
but serves no state (`serves_state` stays False, so nobody picks it as a donor), and leaves at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import random
import signal
import threading
import time
from typing import Optional, Sequence

import hivemind
import torch
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from swarm.config import FaultsConfig, SwarmConfig, live_window
from swarm.errors import SwarmError
from swarm.net import policy, schema
from swarm.net.access import Access
from swarm.net.allreduce import (
    CONCLUSIVE,
    PROOF,
    AllReduce,
    AllReduceFailed,
    Contribution,
    EncodedAverage,
    Rule,
    WireLayout,
)
from swarm.net.budget import chunk_elements, outer_step_deadline
from swarm.net.codec import get_codec, kept_dtype
from swarm.net.corpussync import CorpusServer
from swarm.net.dataplane import DataPlane, hosts_of
from swarm.net.dht import allowed_peers
from swarm.net.grouping import Offenses, OtherBase, adopted, agreed_chunk, clients, dialable, on_majority_base, without
from swarm.net.hostile import Reach, hooks_for
from swarm.net.identity import Identity
from swarm.net.ledger import Ledger
from swarm.net.linger import linger
from swarm.net.matchmaking import Group, Matchmaker, NoGroup
from swarm.net.outcome import Averaging
from swarm.net.records import Records
from swarm.net.statesync import StateForged, StateRefused, StateServer, download
from swarm.net.wire import Traffic, WireError
from swarm.tensors import Buffers
from swarm.train.averaging import Averager, Download, ExchangeOutcome, Intake, PeerStats, Snapshot
from swarm.train.diloco import PseudoGradient

logger = logging.getLogger(__name__)


def _die_now() -> None:
    """Fault injection (`faults.kill_phase: allreduce`): SIGKILL this peer mid all-reduce, like a power cut."""
    logger.warning("fault injection: killing this peer (SIGKILL) inside the all-reduce")
    os.kill(os.getpid(), signal.SIGKILL)


class SwarmAverager(Averager):
    networked = True

    def __init__(self, cfg: SwarmConfig, dht: hivemind.DHT, identity: Identity, fingerprint: str, peer_name: str,
                 faults: Optional[FaultsConfig] = None, ledger: Optional[Ledger] = None):
        self.cfg, self.dht, self.fingerprint, self.peer_name = cfg, dht, fingerprint, peer_name
        self.faults = faults or FaultsConfig()
        self.peer_id = str(dht.peer_id)
        if cfg.auth == "open" and (relaxed := cfg.relaxed()):
            logger.warning(f"an open swarm with {', '.join(relaxed)}: one peer can dictate the average (huge sample "
                           f"counts, a huge pseudo-gradient); relax these only in a private swarm (swarm.auth: "
                           f"allowlist)")
        self._codec = get_codec(cfg.compression)
        self.kept_dtype = kept_dtype(cfg.compression)
        self.averaged_once = False  # until a first group, peers starting with us may not have a record yet
        self._pool = concurrent.futures.ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)),
                                                           thread_name_prefix="swarm-cpu")
        # The averager forks a process: create it before our threads exist.
        self.access = Access(allowed_peers(cfg))
        self.offenses = Offenses(self.access)  # groupmates caught misbehaving: left out of our groups
        self.hooks = hooks_for(self.faults.hostile)  # a hostile peer's attacks (tests and demos only)
        # a hostile leader may declare itself sooner than the others, so that it leads their groups
        matching = dataclasses.replace(cfg, matchmaking_time=self.hooks.matchmaking_time(cfg.matchmaking_time))
        self.matchmaker = Matchmaker(matching, dht, fingerprint, self.access, identity, self.hooks.lead)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-net", daemon=True)
        self._thread.start()
        try:
            self.p2p = self.call(dht.replicate_p2p(), cfg.bootstrap_timeout)
            name = lambda what: schema.handler_name(cfg.run_id, fingerprint, what)  # noqa: E731
            plane = DataPlane(None if cfg.client_mode else hosts_of(cfg.host_maddrs), cfg.data_port,
                              cfg.stall_timeout) if cfg.data_plane else None  # nobody dials a client
            self.allreduce = AllReduce(self.p2p, name("ar"), cfg.stall_timeout, cfg.min_bandwidth, self._pool,
                                       Rule.of(cfg), self.access, self.hooks, identity, plane)
            self.server = StateServer(self.p2p, name("state"), cfg.stall_timeout, self._pool, self.access,
                                      self.hooks)
            self.corpus = CorpusServer(self.p2p, name("corpus"), cfg.stall_timeout, self._pool, self.access,
                                       cfg.corpus_rate)  # offered the corpus once it is known (node.py)
            # our records' subkey is our owner marker: we sign them
            self.records = Records(cfg, dht, self.peer_id, peer_name, identity.owner, self.access, self.hooks,
                                   self.server, identity.work, ledger)
            self.records.start()
            self.call(self._start_handlers(), cfg.bootstrap_timeout)
            others = lambda: [r.peer_id for r in self.records.peers() if r.peer_id != self.peer_id]  # noqa: E731
            reach = Reach(self.p2p, name, cfg.stall_timeout, others, dht, cfg)
            asyncio.run_coroutine_threadsafe(self.hooks.run(reach), self._loop)
        except BaseException:
            self.close()
            raise

    def call(self, coro, timeout: Optional[float]):
        """Run `coro` on the network thread; wait at most `timeout` s (then cancel it and raise TimeoutError)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"network call did not finish within {timeout:g} s") from None

    @property
    def pool(self) -> concurrent.futures.Executor:
        """The threads that do the network side's CPU work (encoding, reducing, reading a state)."""
        return self._pool

    async def _start_handlers(self) -> None:
        """Nobody can dial a client, and no honest peer tries: a client offers no handler at all, so a stream
        opened to it fails at once instead of waiting on a connection that happens to be open."""
        if not self.cfg.client_mode:
            await self.allreduce.start()
            await self.server.start()
            await self.corpus.start()

    # ---- records --------------------------------------------------------------------------------------

    def publish_progress(self, outer_step: int, inner_step: int, samples: int, samples_per_s: float,
                         ready: bool = False, sha256: str = "", stats: Optional[PeerStats] = None,
                         wait: bool = False) -> None:
        self.records.publish_progress(outer_step, inner_step, samples, samples_per_s, ready, sha256, stats, wait)

    def round_over(self, outer_step: int) -> bool:
        return self.records.round_over(outer_step)

    def offer_state(self, snapshot: Snapshot, wait: bool = False) -> None:
        self.records.offer_state(snapshot, wait)

    # ---- averaging: assess -> form a group -> reduce -> decide, until the outer step's deadline ---------------

    def result_buffers(self, shapes: Sequence[torch.Size]) -> EncodedAverage:
        """The average in the wire's bytes until the outer step reads it (int8: a quarter of fp32's memory)."""
        return EncodedAverage(shapes)

    def average(self, outer_step: int, pseudo_grad: PseudoGradient, samples: int,
                out: Sequence[torch.Tensor] | Buffers, base: str = "") -> ExchangeOutcome:
        if not pseudo_grad.is_finite():
            return ExchangeOutcome(None, note="the local pseudo-gradient is not finite; not sent")
        job = self._begin(outer_step, pseudo_grad, samples, out, base)
        # hivemind refuses a step whose timeout is shorter than its matchmaking time: stop before that.
        while (left := job.deadline - time.monotonic()) > self.cfg.matchmaking_time:
            position = self._assess(job)
            if isinstance(position, ExchangeOutcome):
                return position
            group = self._form_group(job, position, left)
            if isinstance(group, ExchangeOutcome):
                return group
            while group is not None:
                if (traffic := self._reduce(job, group)) is not None:
                    return self._decide(job, group, traffic)
                group = self._regroup(group)
        return job.discarded()

    def _begin(self, outer_step: int, pseudo_grad: PseudoGradient, samples: int,
               out: Sequence[torch.Tensor] | Buffers, base: str) -> Averaging:
        """The call's bounds and metadata; announce that we are ready for this outer step."""
        full = WireLayout(pseudo_grad.shapes, self._codec, 1)
        chunk = chunk_elements(self.cfg.stall_timeout, self.cfg.min_bandwidth)
        meta = {"samples": int(samples), "numel": full.numel, "base": base, "chunk": chunk}
        if self.cfg.client_mode:  # only then: a peer of an earlier version refuses a meta with keys it lacks
            meta["client"] = True
        job = Averaging(outer_step, pseudo_grad, samples, out, base, full, meta)
        self.offenses.begin(outer_step)
        job.deadline = job.start + outer_step_deadline(2 * full.part_wire_bytes(0), self.cfg)  # 2 (n-1)/n V < 2 V
        if self.cfg.error_feedback and self._codec.lossy:
            job.residual = [torch.zeros(s) for s in pseudo_grad.shapes]
        if self.faults.kill_phase == "allreduce" and self.faults.kill_round == outer_step + 1:
            self.allreduce.on_pushed = _die_now
        if not self.records.announced_ready(outer_step):
            self.publish_progress(outer_step, 0, samples, 0.0, ready=True, sha256=base)
        return job

    def _assess(self, job: Averaging) -> policy.Position | ExchangeOutcome:
        """Where we stand by the records; an outcome when that settles the outer step: behind or diverged (take the
        state), or alone once we have averaged with others (a lone survivor does not wait for nobody)."""
        position = self.records.assess(job.outer_step, job.base)
        if position.verdict in (policy.Verdict.BEHIND, policy.Verdict.DIVERGED):
            return job.behind(list(position.donors), position.note)
        if self.averaged_once and position.verdict is policy.Verdict.ALONE and position.expected_group == 1:
            return self._alone(job)
        return position

    def _form_group(self, job: Averaging, position: policy.Position, left: float) -> Group | ExchangeOutcome | None:
        """Matchmaking, less the offenders and the groupmates on a minority's base; None: retry (job.reason)."""
        job.expected = position.expected_group if self.averaged_once else None
        try:
            group = self.matchmaker.form_group(job.outer_step, self.hooks.meta(job.meta),
                                               timeout=min(left, 2 * self.cfg.matchmaking_time), expected=job.expected)
            kept, dropped = self.offenses.exclude(group, job.outer_step)  # first: their meta is unread
            if dropped:
                self._abandon(group, "offenders left out", dropped)  # whoever runs it; `_regroup` on their side
                group = kept
            return on_majority_base(group, job.base)
        except OtherBase as e:
            return job.behind(e.donors, str(e))
        except NoGroup as e:
            job.reason = e.reason
            for culprit in e.culprits:  # charged by the matchmaker already: out of our groups this outer step
                self.offenses.record(culprit, job.outer_step, e.reason, proven=False)
            if e.left is not None:  # groupmates that believe in this group must not wait for us
                self._abandon(e.left, e.reason)
            if e.alone and self.records.assess(job.outer_step, job.base).verdict == policy.Verdict.ALONE:
                return self._alone(job)
            logger.info(f"outer step {job.outer_step + 1}: {job.reason}; retrying")
            return None

    def _reduce(self, job: Averaging, group: Group) -> Optional[tuple[Traffic, float]]:
        """The all-reduce in `group` into `job.out`: its traffic and duration; None: it failed (job.reason),
        and a groupmate it names as the culprit is left out of our next groups."""
        logger.info(f"outer step {job.outer_step + 1}: group formed with {len(group.members)} peers in "
                    f"{job.elapsed():.2f} s" + (f" (the records led us to wait for {job.expected})"
                                               if job.expected is not None else ""))
        for r in job.residual or []:
            r.zero_()
        try:
            layout = WireLayout(job.pseudo_grad.shapes, self._codec, len(group.members), agreed_chunk(group),
                                clients(group))
            contribution = Contribution(job.pseudo_grad.read, self.hooks.weight(float(job.samples)), job.out,
                                        job.residual)
            bound = self.allreduce.deadline(layout, group.members.index(self.p2p.peer_id)) + self.cfg.stall_timeout
            start = time.monotonic()
            traffic = self.call(self.allreduce.run(group.group_id, group.members, layout, contribution,
                                                   [m.get("samples") for m in group.metas],
                                                   [m.get("key") for m in group.metas]), bound)
            return traffic, time.monotonic() - start
        except (AllReduceFailed, TimeoutError) as e:
            job.reason = str(e)
            culprit = getattr(e, "culprit", None)
            if culprit is not None and str(culprit) != self.peer_id:
                self.offenses.record(culprit, job.outer_step, job.reason, proven=e.blame in (PROOF, CONCLUSIVE),
                                     conclusive=e.blame == CONCLUSIVE)
            logger.warning(f"outer step {job.outer_step + 1}: all-reduce in a group of {len(group.members)} "
                           f"failed: {e}; retrying")
            return None

    def _decide(self, job: Averaging, group: Group, done: tuple[Traffic, float]) -> ExchangeOutcome:
        """The group's average is in `job.out` on every member: its members are known to our ledger for this
        outer step, we sign its statement (certificates.py) for the commit, and from now on a lone survivor skips
        matchmaking."""
        self.records.ledger.record(job.outer_step + 1, [str(m) for m in group.members])
        self.records.sign(job.outer_step + 1, job.base, group.group_id, len(group.members))
        self.averaged_once = True
        return job.averaged(group, *done)

    def _alone(self, job: Averaging) -> ExchangeOutcome:
        """Our own pseudo-gradient as the outer step's average, stated as a group of one."""
        self.records.sign(job.outer_step + 1, job.base, b"", 1)
        return job.alone()

    def _regroup(self, group: Group) -> Optional[Group]:
        """After `group` failed: the group without the members that most groupmates left out of it (they run it
        already: grouping.adopted), to run at once; None: back to matchmaking (AllReduce.regroup declines the
        groups without others that groupmates asked us to run, so that they do not wait for us)."""
        dropped = self.call(self.allreduce.regroup(group.group_id, lambda named: adopted(group, self.peer_id, named),
                                                   self.cfg.request_timeout),
                            self.cfg.request_timeout + self.cfg.stall_timeout)
        if dropped is None:
            return None
        logger.info(f"averaging without {sorted(dropped)}, as most groupmates that stay do")
        return without(group, dropped)

    def _abandon(self, group: Group, reason: str, dropped: Sequence[str] = ()) -> None:
        """Tell the groupmates we can dial that we leave `group`, so that they do not wait for us; `dropped`: the
        members we left out of it, in the group we run instead (grouping.without)."""
        asyncio.run_coroutine_threadsafe(self.allreduce.abandon(group.group_id, dialable(group), reason,
                                                                sorted(dropped)), self._loop)

    # ---- state ----------------------------------------------------------------------------------------

    def fetch_state(self, intake: Intake, outer_step: int, sha256: str, donors: Optional[list[str]] = None,
                    must: bool = False) -> Optional[Download]:
        self.records.withdraw_state()  # our state is about to be overwritten: serve nothing meanwhile
        self.publish_progress(outer_step, 0, 0, 0.0, ready=False, sha256=sha256, wait=True)
        start, tried = time.monotonic(), {}
        deadline = start + live_window(self.cfg) + self.cfg.stall_timeout
        written = []  # a refused download may have overwritten part of our state: then only a whole one may follow
        destinations = intake.destinations
        intake = Intake(lambda specs: written.append(True) or destinations(specs), intake.accept)
        while True:
            position = self.records.assess(outer_step, sha256)
            needed = must or position.verdict in (policy.Verdict.BEHIND, policy.Verdict.DIVERGED)
            # the policy's donors in random order: the load spreads, and a key ground to sort first is not every
            # newcomer's first donor
            candidates = list(donors) if donors else random.sample(position.donors, len(position.donors))
            if must:
                live = [r for r in self.records.peers() if r.peer_id != self.peer_id and r.serves_state
                        and r.outer_step >= outer_step and policy.is_live(r, get_dht_time(), live_window(self.cfg))]
                candidates = [r.peer_id for r in sorted(live, key=lambda r: (-r.outer_step, random.random()))]
            if position.verdict is policy.Verdict.UNSURE and not candidates and time.monotonic() < deadline:
                time.sleep(self.cfg.progress_interval)  # our own fresh record is not readable yet: read again
                continue
            if not needed and not candidates:
                return None
            for peer_id in [c for c in candidates if self.access.admits(c)]:
                try:
                    check = lambda r, h, must=must: self._check_state(r, h, outer_step, sha256, must)  # noqa: E731
                    got = self.call(download(self.p2p, PeerID.from_base58(peer_id), self.server.name,
                                              self.cfg.stall_timeout, self.cfg.min_bandwidth, intake, check,
                                              self._pool), None)
                except (StateRefused, WireError, ValueError) as e:
                    logger.warning(f"state from {peer_id} refused: {e}")
                    if isinstance(e, StateForged):
                        self.access.offense(peer_id, f"served a forged state: {e}")
                    tried[peer_id] = str(e)
                    must = must or bool(written)
                    continue
                self.records.ledger.record(got.outer_step, self._holders(got.outer_step, got.sha256))
                # a groupmate from now on: peers matching for the next outer step wait for us rather than close it alone
                self.publish_progress(got.outer_step, 0, 0, 0.0, ready=False, sha256=got.sha256, wait=True)
                logger.info(f"fetched the state of outer step {got.outer_step} from {peer_id}: "
                            f"{got.bytes / 1e6:.0f} MB in {got.seconds:.1f} s "
                            f"({got.bytes / 1e6 / max(got.seconds, 1e-9):.0f} MB/s)")
                return got
            if not needed:
                return None
            if time.monotonic() > deadline:
                raise SwarmError(
                    f"the swarm reached outer step {position.swarm_outer_step} (global parameters "
                    f"{(position.swarm_sha256 or '?')[:12]}) and this peer holds outer step {outer_step}, but no peer "
                    f"could give its state within {time.monotonic() - start:.0f} s; tried: "
                    f"{', '.join(tried) or 'nobody serves it (every peer at that outer_step has left)'}")
            time.sleep(self.cfg.progress_interval)

    def _holders(self, outer_step: int, sha256: str) -> list[str]:
        """Us, and the live peers whose records hold (`outer_step`, `sha256`) and that vote on it for us (all of them
        while our ledger knows nothing before `outer_step`): whom the ledger credits with a state we took."""
        votes = policy.votes_on(self.records.ledger.known, outer_step)
        return [self.peer_id, *(r.peer_id for r in self.records.peers()
                                if r.outer_step == outer_step and r.sha256 == sha256
                                and policy.is_live(r, get_dht_time(), live_window(self.cfg)) and votes(r.peer_id))]

    def _check_state(self, got_outer_step: int, got_sha: str, outer_step: int, sha256: str,
                     must: bool) -> Optional[str]:
        """Why a donor's state of (got_outer_step, got_sha) must not replace ours at (outer_step, sha256); None: take
        it."""
        if got_outer_step < outer_step or (got_outer_step == outer_step and got_sha == sha256 and not must):
            return f"not newer than ours (outer step {outer_step})"
        commits = self.records.read(schema.commits_key(self.cfg.run_id), schema.CommitRecord)
        if commits is None:
            return "the commit records did not answer"
        commits.pop(self.peer_id, None)  # our own vote is the state we are replacing
        others = [r for r in self.records.peers() if r.peer_id != self.peer_id]
        backed = policy.backing(others, commits, self.records.anchor())
        committed = policy.certified(self.peer_id, others, commits, get_dht_time(), live_window(self.cfg),
                                     self.records.ledger.known, backed, own=outer_step).get(got_outer_step)
        if committed is None:
            return (f"no hash of outer step {got_outer_step} is held by half of the live peers, nor by most of ours "
                    f"(the quorum rule)")
        if committed != got_sha:
            return f"the swarm committed {committed[:12]} at outer step {got_outer_step}"
        return None

    # ---- shutdown -------------------------------------------------------------------------------------

    def finish(self, outer_step: int, sha256: str) -> Optional[list[str]]:
        """Our last commit and record out, then `linger.linger` (what it waits for, and why)."""
        self.records.flush_commit()
        self.publish_progress(outer_step, 0, 0, 0.0, sha256=sha256, wait=True)
        return linger(self.records, self.cfg, self.peer_id, outer_step, sha256)

    async def _stop_handlers(self) -> None:
        if hasattr(self, "server") and not self.cfg.client_mode:
            await self.allreduce.stop()
            await self.server.stop()
            await self.corpus.stop()
        if hasattr(self, "p2p"):
            await self.p2p.shutdown()  # a replica: closes our client, the DHT's daemon keeps running
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:  # streams still open (a groupmate's, a newcomer's): end them before the loop goes
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def close(self) -> None:
        if hasattr(self, "records"):
            self.records.close()  # a commit offered just before leaving: others take their bearings from it
        if self._thread.is_alive():
            if hasattr(self, "allreduce"):  # serve our last parts to groupmates still taking them, then stop
                try:
                    if held := self.call(self.allreduce.drain(), 2 * self.cfg.stall_timeout):
                        logger.info(f"served {held} finished all-reduce(s) to groupmates before leaving")
                except TimeoutError as e:
                    logger.warning(f"serving the last all-reduce before leaving: {e}")
            try:
                self.call(self._stop_handlers(), self.cfg.request_timeout)
            except Exception as e:  # the daemon may be gone already; shutting down anyway
                logger.warning(f"closing the network handlers failed: {e!r}")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(self.cfg.request_timeout)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.matchmaker.close()
