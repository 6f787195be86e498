"""`SwarmAverager`: the trainer's `Averager` over a hivemind DHT.

A background thread runs an asyncio loop that holds a P2P replica of the DHT's daemon, the all-reduce
(allreduce.py) and the state server (statesync.py); a thread pool does their CPU work. The trainer's thread
calls in with bounded waits:

- `average()`: each attempt first reads the DHT records and asks `policy.assess` where this peer stands:
  behind the swarm or on a minority's parameters -> `behind=True` (take the state, do not average stale
  work); otherwise matchmaking for the round (matchmaking.py), then the streamed all-reduce into the
  trainer's buffers. A failed attempt is retried with whoever is still alive until the round's deadline
  (`budget.round_deadline`, from the vector's bytes), after which the round is discarded (averaged=None),
  never half-averaged. A peer that meets nobody and that the records show alone applies its own step; once it
  has averaged with others, it does so without matchmaking when the records show nobody else live at its
  round or the one before (a lone survivor waited 2 x matchmaking_time every round for nobody; until its
  first group, peers starting with it may not have a record yet).
- `publish_progress()`, `others_ready()`: this peer's signed progress record and the others' (records.py).
- `offer_state()`: record the commit (`{run_id}_commits`), then serve this snapshot to newcomers (records.py).
- `fetch_state()`: take the swarm's state from the donors the policy names, verified against the hash the
  swarm committed; SwarmError if the swarm is ahead and no donor can give it within the live window plus
  `stall_timeout`.
- `finish()`: after the last round, serve the state while live peers are behind (`cfg.linger_time`).

Every "round" here is what the trainer passes: its count of committed outer steps. With one fragment that is
its round; with `diloco.fragments` F it counts every fragment's exchange, F per round (swarm/fragments.py), so
records, commits, state offers and downloads follow each exchange.

A client (`swarm.client_mode`: a peer that cannot be dialed, e.g. behind a NAT) owns no part of the
all-reduce (it pushes to the owners and takes the averages back on its own streams), records its commits
but serves no state (`serves_state` stays False, so nobody picks it as a donor), and leaves at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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

from swarm.averaging import Averager, Download, Intake, PeerStats, RoundOutcome, Snapshot
from swarm.config import FaultsConfig, SwarmConfig, live_window
from swarm.diloco import PseudoGradient
from swarm.errors import SwarmError
from swarm.net import policy, schema
from swarm.net.access import Access
from swarm.net.allreduce import AllReduce
from swarm.net.budget import chunk_elements, round_deadline
from swarm.net.codec import get_codec
from swarm.net.dht import allowed_peers
from swarm.net.grouping import Offenses, OtherBase, agreed_chunk, clients, dialable, on_majority_base
from swarm.net.groupstate import AllReduceFailed, Contribution
from swarm.net.hostile import hooks_for
from swarm.net.identity import Identity
from swarm.net.layout import WireLayout
from swarm.net.matchmaking import Group, Matchmaker, NoGroup
from swarm.net.records import Records
from swarm.net.robust import Rule
from swarm.net.statesync import StateForged, StateRefused, StateServer, download
from swarm.net.wire import WireError

logger = logging.getLogger(__name__)


def _die_now() -> None:
    """Fault injection (`faults.kill_phase: allreduce`): SIGKILL this peer mid all-reduce, like a power cut."""
    logger.warning("fault injection: killing this peer (SIGKILL) inside the all-reduce")
    os.kill(os.getpid(), signal.SIGKILL)


class SwarmAverager(Records, Averager):
    networked = True

    def __init__(self, cfg: SwarmConfig, dht: hivemind.DHT, identity: Identity, fingerprint: str, peer_name: str,
                 faults: Optional[FaultsConfig] = None):
        self.cfg, self.dht, self.fingerprint, self.peer_name = cfg, dht, fingerprint, peer_name
        self.faults = faults or FaultsConfig()
        self.peer_id, self._owner = str(dht.peer_id), identity.owner  # our records' subkey: we sign them
        self._codec = get_codec(cfg.compression)
        self._last_progress: Optional[tuple] = None  # publish_progress arguments, re-sent by the heartbeat
        self._stats = PeerStats()  # the last ones the trainer gave, in every record until it gives others
        self._ready_seen: tuple[int, float, bool] = (-1, 0.0, False)  # others_ready: (round, when asked, answer)
        self._averaged_once = False  # until a first group, peers starting with us may not have a record yet
        self._dht_lock = threading.Lock()  # the trainer's thread and the heartbeat share the DHT's pipe
        self._stopping = threading.Event()
        self._progress_due = threading.Event()
        self._commit_lock = threading.Lock()
        self._offered: Optional[Snapshot] = None  # the state offer_state was last given (None: withdrawn)
        self._pending_commit: Optional[Snapshot] = None  # offered, its commit record not stored yet
        self._storing: set[concurrent.futures.Future] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)),
                                                           thread_name_prefix="swarm-cpu")
        # The averager forks a process: create it before our threads exist.
        self.access = Access(allowed_peers(cfg))
        self._offenses = Offenses(self.access)  # groupmates caught misbehaving: left out of our groups
        self.hooks = hooks_for(self.faults.hostile)  # a hostile peer's attacks (tests and demos only)
        self._published: Optional[schema.ProgressRecord] = None  # our last record, as we made it
        self._committed = ""  # hash of the global parameters of our last commit (offer_state)
        self._matchmaker = Matchmaker(cfg, dht, fingerprint, self.access)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-net", daemon=True)
        self._thread.start()
        self._beat = threading.Thread(target=self._heartbeat, name="swarm-heartbeat", daemon=True)
        self._beat.start()
        try:
            self._p2p = self._call(dht.replicate_p2p(), cfg.bootstrap_timeout)
            name = lambda what: schema.handler_name(cfg.run_id, fingerprint, what)  # noqa: E731
            self._allreduce = AllReduce(self._p2p, name("ar"), cfg.stall_timeout, cfg.min_bandwidth, self._pool,
                                        Rule.of(cfg), self.access, self.hooks)
            self._server = StateServer(self._p2p, name("state"), cfg.stall_timeout, self._pool, self.access,
                                       self.hooks)
            self._state_handler = name("state")
            self._call(self._start_handlers(), cfg.bootstrap_timeout)
            others = lambda: [r.peer_id for r in self.peers() if r.peer_id != self.peer_id]  # noqa: E731
            asyncio.run_coroutine_threadsafe(self.hooks.run(self._p2p, name("ar"), others), self._loop)
        except BaseException:
            self.close()
            raise

    def _call(self, coro, timeout: Optional[float]):
        """Run `coro` on the network thread; wait at most `timeout` s (then cancel it and raise TimeoutError)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"network call did not finish within {timeout:g} s") from None

    async def _start_handlers(self) -> None:
        """Nobody can dial a client, and no honest peer tries: a client offers no handler at all, so a stream
        opened to it fails at once instead of waiting on a connection that happens to be open."""
        if not self.cfg.client_mode:
            await self._allreduce.start()
            await self._server.start()

    # ---- averaging ------------------------------------------------------------------------------------

    def average(self, round: int, pseudo_grad: PseudoGradient, samples: int, out: Sequence[torch.Tensor],
                base: str = "") -> RoundOutcome:
        start = time.monotonic()
        if not pseudo_grad.is_finite():
            return RoundOutcome(None, note="the local pseudo-gradient is not finite; not sent")
        full = WireLayout(pseudo_grad.shapes, self._codec, 1)
        chunk = chunk_elements(self.cfg.stall_timeout, self.cfg.min_bandwidth)
        deadline = start + round_deadline(2 * full.part_wire_bytes(0), self.cfg)  # 2 (n-1)/n V < 2 V
        residual = ([torch.zeros(s) for s in pseudo_grad.shapes]
                    if self.cfg.error_feedback and self._codec.lossy else None)
        sent = received = 0
        reason = "the round's deadline is too short for one attempt"
        meta = {"samples": int(samples), "numel": full.numel, "base": base, "chunk": chunk}
        if self.cfg.client_mode:  # only then: a peer of an earlier version refuses a meta with keys it lacks
            meta["client"] = True
        if self.faults.kill_phase == "allreduce" and self.faults.kill_round == round + 1:
            self._allreduce.on_pushed = _die_now
        if self._last_progress is None or self._last_progress[0] != round or not self._last_progress[4]:
            self.publish_progress(round, 0, samples, 0.0, ready=True, sha256=base)  # announce: ready for this round
        # hivemind refuses a step whose timeout is shorter than its matchmaking time: stop before that.
        while (left := deadline - time.monotonic()) > self.cfg.matchmaking_time:
            position = self._assess(round, base)
            if position.verdict in (policy.Verdict.BEHIND, policy.Verdict.DIVERGED):
                return RoundOutcome(None, comm_s=time.monotonic() - start, behind=True,
                                    donors=list(position.donors), note=position.note)
            if self._averaged_once and position.verdict is policy.Verdict.ALONE and position.expected_group == 1:
                return self._alone(pseudo_grad, samples, out, start)
            try:
                group = self._matchmaker.form_group(
                    round, self.hooks.meta(meta),
                    timeout=min(left, 2 * self.cfg.matchmaking_time),
                    expected=position.expected_group if self._averaged_once else None)
                if (kept := self._offenses.exclude(group, round)) is not group:  # first: their meta is unread
                    self._abandon(group, "offenders left out")  # whoever runs it
                    group = kept
                group = on_majority_base(group, base)
            except OtherBase as e:
                return RoundOutcome(None, comm_s=time.monotonic() - start, behind=True, donors=e.donors,
                                    note=str(e))
            except NoGroup as e:
                reason = e.reason
                if e.left is not None:  # groupmates that believe in this group must not wait for us
                    self._abandon(e.left, e.reason)
                if e.alone and self._assess(round, base).verdict == policy.Verdict.ALONE:
                    return self._alone(pseudo_grad, samples, out, start)
                logger.info(f"round {round + 1}: {reason}; retrying")
                continue
            logger.debug(f"round {round + 1}: a group of {len(group.members)} after {time.monotonic() - start:.2f} s")
            if residual is not None:
                for r in residual:
                    r.zero_()
            try:
                if any(m.get("numel") != full.numel for m in group.metas):
                    raise AllReduceFailed(f"groupmates average vectors of other sizes: "
                                          f"{[m.get('numel') for m in group.metas]}")
                layout = WireLayout(pseudo_grad.shapes, self._codec, len(group.members), agreed_chunk(group),
                                    clients(group))
                contribution = Contribution(pseudo_grad.read, self.hooks.weight(float(samples)), out, residual)
                me = group.members.index(self._p2p.peer_id)
                bound = self._allreduce.deadline(layout, me) + self.cfg.stall_timeout
                allreduce_start = time.monotonic()
                traffic = self._call(self._allreduce.run(group.group_id, group.members, layout, contribution,
                                                         [m.get("samples") for m in group.metas]), bound)
            except (AllReduceFailed, TimeoutError) as e:
                reason = str(e)
                if getattr(e, "culprit", None) is not None:
                    self._offenses.record(e.culprit, round, reason)
                logger.warning(f"round {round + 1}: all-reduce in a group of {len(group.members)} failed: {e}; "
                               f"retrying")
                continue
            sent, received = traffic.sent, traffic.received
            self._averaged_once = True
            return RoundOutcome(out, group_size=len(group.members), residual=residual,
                                total_samples=sum(int(m.get("samples", 0)) for m in group.metas),
                                bytes_sent=sent, bytes_received=received, comm_s=time.monotonic() - start,
                                allreduce_s=time.monotonic() - allreduce_start, note=f"group of {len(group.members)}")
        return RoundOutcome(None, bytes_sent=sent, bytes_received=received, comm_s=time.monotonic() - start,
                            note=f"round {round + 1} discarded after {time.monotonic() - start:.0f} s "
                                 f"(the round's deadline, budget.round_deadline): {reason}")

    @staticmethod
    def _alone(pseudo_grad: PseudoGradient, samples: int, out: Sequence[torch.Tensor], start: float) -> RoundOutcome:
        """Our own pseudo-gradient as the round's average."""
        for i, o in enumerate(out):
            o.copy_(pseudo_grad.read(i, 0, o.numel()).view(o.shape))
        return RoundOutcome(out, total_samples=samples, comm_s=time.monotonic() - start, note="alone")

    def _abandon(self, group: Group, reason: str) -> None:
        """Tell the groupmates we can dial that we leave `group`, so that they do not wait for us."""
        asyncio.run_coroutine_threadsafe(self._allreduce.abandon(group.group_id, dialable(group), reason), self._loop)

    # ---- state ----------------------------------------------------------------------------------------

    def fetch_state(self, intake: Intake, round: int, sha256: str, donors: Optional[list[str]] = None,
                    must: bool = False) -> Optional[Download]:
        self._withdraw_state()  # our state is about to be overwritten: serve nothing meanwhile
        self.publish_progress(round, 0, 0, 0.0, ready=False, sha256=sha256, wait=True)
        start, tried = time.monotonic(), {}
        deadline = start + live_window(self.cfg) + self.cfg.stall_timeout
        written = []  # a refused download may have overwritten part of our state: then only a whole one may follow
        destinations = intake.destinations
        intake = Intake(lambda specs: written.append(True) or destinations(specs), intake.accept)
        while True:
            position = self._assess(round, sha256)
            needed = must or position.verdict in (policy.Verdict.BEHIND, policy.Verdict.DIVERGED)
            candidates = list(donors or position.donors)
            if must:
                live = [r for r in self.peers() if r.peer_id != self.peer_id and r.serves_state
                        and r.round >= round and policy.is_live(r, get_dht_time(), live_window(self.cfg))]
                candidates = [r.peer_id for r in sorted(live, key=lambda r: (-r.round, random.random()))]
            if position.verdict is policy.Verdict.UNSURE and not candidates and time.monotonic() < deadline:
                time.sleep(self.cfg.progress_interval)  # our own fresh record is not readable yet: read again
                continue
            if not needed and not candidates:
                return None
            for peer_id in [c for c in candidates if self.access.admits(c)]:
                try:
                    check = lambda r, h, must=must: self._check_state(r, h, round, sha256, must)  # noqa: E731
                    got = self._call(download(self._p2p, PeerID.from_base58(peer_id), self._state_handler,
                                              self.cfg.stall_timeout, self.cfg.min_bandwidth, intake, check,
                                              self._pool), None)
                except (StateRefused, WireError, ValueError) as e:
                    logger.warning(f"state from {peer_id} refused: {e}")
                    if isinstance(e, StateForged):
                        self.access.offense(peer_id, f"served a forged state: {e}")
                    tried[peer_id] = str(e)
                    must = must or bool(written)
                    continue
                logger.info(f"fetched the state of round {got.round} from {peer_id}: {got.bytes / 1e6:.0f} MB in "
                            f"{got.seconds:.1f} s ({got.bytes / 1e6 / max(got.seconds, 1e-9):.0f} MB/s)")
                return got
            if not needed:
                return None
            if time.monotonic() > deadline:
                raise SwarmError(
                    f"the swarm reached round {position.swarm_round} (global parameters "
                    f"{(position.swarm_sha256 or '?')[:12]}) and this peer holds round {round}, but no peer could "
                    f"give its state within {time.monotonic() - start:.0f} s; tried: "
                    f"{', '.join(tried) or 'nobody serves it (every peer at that round has left)'}")
            time.sleep(self.cfg.progress_interval)

    def _check_state(self, got_round: int, got_sha: str, round: int, sha256: str, must: bool) -> Optional[str]:
        """Why a donor's state of (got_round, got_sha) must not replace ours at (round, sha256); None: take it."""
        if got_round < round or (got_round == round and got_sha == sha256 and not must):
            return f"not newer than ours (round {round})"
        commits = self._read(schema.commits_key(self.cfg.run_id), schema.CommitRecord)
        commits.pop(self.peer_id, None)  # our own vote is the state we are replacing
        others = [r for r in self.peers() if r.peer_id != self.peer_id]
        now, window = get_dht_time(), live_window(self.cfg)
        tally = policy.votes(*policy.plausible(self.peer_id, others, commits, now, window), now, window)
        committed = policy.winner(tally.get(got_round))
        if committed is None:
            return f"no peer vouches for round {got_round}"
        if committed != got_sha:
            return f"the swarm committed {committed[:12]} at round {got_round}"
        return None

    # ---- shutdown -------------------------------------------------------------------------------------

    def finish(self, round: int) -> None:
        """Serve the final state while live peers are at earlier rounds, at most `cfg.linger_time` s.

        A peer that fell behind in the last rounds (a failed all-reduce, a slow machine) learns it only
        after its next matchmaking; if every peer ahead has left by then it finds no donor and stops.
        Peers that finished announce it (a record at their final round), so in a swarm where nobody is
        behind this returns at once. A client (`swarm.client_mode`) serves nothing: it returns at once.
        """
        self._flush_commit()
        self.publish_progress(round, 0, 0, 0.0, sha256=self._committed, wait=True)
        if self.cfg.client_mode:
            return
        deadline, waiting_for = time.monotonic() + self.cfg.linger_time, None
        while time.monotonic() < deadline:
            now = get_dht_time()
            behind = sorted(r.name for r in self.peers() if r.round < round and r.peer_id != self.peer_id
                            and policy.is_live(r, now, live_window(self.cfg)))
            if not behind:
                return
            if behind != waiting_for:
                logger.info(f"finished at round {round}; serving the state to peers still behind: {behind}")
                waiting_for = behind
            time.sleep(max(0.0, min(self.cfg.progress_interval, 1.0, deadline - time.monotonic())))  # poll
        logger.warning(f"stopped serving the state after {self.cfg.linger_time:g} s (swarm.linger_time); "
                       f"still behind: {waiting_for}")

    async def _stop_handlers(self) -> None:
        if hasattr(self, "_server") and not self.cfg.client_mode:
            await self._allreduce.stop()
            await self._server.stop()
        if hasattr(self, "_p2p"):
            await self._p2p.shutdown()  # a replica: closes our client, the DHT's daemon keeps running
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:  # streams still open (a groupmate's, a newcomer's): end them before the loop goes
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def close(self) -> None:
        self._stopping.set()
        self._progress_due.set()  # wakes the heartbeat, which sees _stopping
        self._beat.join(self.cfg.request_timeout + self.cfg.progress_interval)
        self._flush_commit()  # a commit offered just before leaving: others take their bearings from it
        if self._thread.is_alive():
            if hasattr(self, "_allreduce"):  # serve our last parts to groupmates still taking them, then stop
                try:
                    if held := self._call(self._allreduce.drain(), 2 * self.cfg.stall_timeout):
                        logger.info(f"served {held} finished all-reduce(s) to groupmates before leaving")
                except TimeoutError as e:
                    logger.warning(f"serving the last all-reduce before leaving: {e}")
            try:
                self._call(self._stop_handlers(), self.cfg.request_timeout)
            except Exception as e:  # the daemon may be gone already; shutting down anyway
                logger.warning(f"closing the network handlers failed: {e!r}")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(self.cfg.request_timeout)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._matchmaker.close()
