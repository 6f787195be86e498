"""Group formation with hivemind's public `DecentralizedAverager`, used only to agree on a group.

`averager.step(gather=meta)` on a 1-element tensor returns `{peer_id: meta}` in the same order on every
member (the leader's order). The all-reduce of one float that follows is a cheap barrier, and a checked
one: each member puts a random token in the tensor and in its meta, and the result must be the mean of
the gathered tokens: hivemind reports an all-reduce that missed a member as a success ("Reducer:
received 50.0% of input tensors"), which would leave a member whose groupmate already left matchmaking in a
phantom group, waiting for parts that never come. A failed barrier retries at once and tells the groupmates
(`AllReduce.abandon`): those for whom it did succeed drop the group at once too, instead of waiting for this
peer's parts until they stall. The real all-reduce runs in allreduce/.

Outer step tagging: the averager's group key is `{run_id}_{fingerprint}.0b{outer_step as 32 bits}`.
- the prefix makes peers of another run, or of this run with other model/run settings, never meet;
- the group bits are set to the outer step before every step (`set_group_bits`; hivemind rewrites them
  after each group), so only peers of the same outer step meet.

Each member's meta carries a fresh random nonce, so the group id (a hash of the gathered metadata in
group order) differs on every attempt, also when the same peers retry together.

Group size: every step's target is the number of live peers at this outer step or still showing the one
before (their progress records, us included), capped by `target_group_size`: the leader starts as soon
as they all joined. A peer not yet visible (a newcomer) may miss the group; it then finds the swarm ahead
and downloads the state. A peer's first group waits the full matchmaking_time: peers started with it may
not have published a record yet.

A client (`swarm.client_mode`, a peer that cannot be dialed) never leads: hivemind's averager in client mode
only joins leaders, over the streams it opens to them; a group of clients alone never forms. Its meta says
`client`, so that it owns no part of the all-reduce (allreduce/layout.py).

Every member's meta is its own: signed by it (signedmeta.py), checked by the leader when it joins and by
every member before it uses the group; a meta not signed by its member was forged by the leader that
assembled the group, which is charged the offense (`NoGroup.culprits`). A signed meta is then untrusted as
any: it must fit `GroupMeta` (strict types, bounded sizes) and ours (the outer step, the vector's size) or the
group is left and the member that signed it charged an offense (access.py); a group holding a peer that
`Access` refuses (not in the allowlist, or banned) is left to the caller, which leaves that peer out, and a
group a refused peer assembled is left; as a leader this peer refuses such peers' join requests.

The barrier cannot name a culprit: hivemind averages the tokens on one member, out of our sight, so a
mismatch may be a member that left (a phantom), a member that put another token in, or the member that
averaged them. So it decides only the first attempt of an outer step that fails it (left at once: a phantom is
the common case); in later attempts of the outer step a mismatch is logged and the group used: the all-reduce
then checks who is there, where every member's HELLO reaches each owner itself. A hostile token costs one
attempt per outer step.

Timeouts, all from SwarmConfig:
- `min_matchmaking_time = matchmaking_time`: how long a leader waits for followers it expects but
  that do not come (a peer that died with its record still fresh);
- `request_timeout`: a follower's wait for a leader's answer (below matchmaking_time, or leaders deadlock);
- `allreduce_timeout` (= stall_timeout) / `next_chunk_timeout`: bound hivemind's dummy all-reduce; hivemind's
  defaults are None, with which a peer killed mid-round left survivors hanging for minutes;
- `step(timeout=...)`: the caller's deadline for one attempt; `allow_retries=False`, retries are ours;
- every other call into the averager's process (group bits, group size, bans, its tensor lock) waits at most
  `request_timeout`: a stuck averager makes the attempt fail (NoGroup), never hangs the trainer.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext, P2PHandlerError, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.serializer import MSGPackSerializer
from pydantic.v1 import BaseModel, StrictBool, StrictBytes, ValidationError, confloat, conint, constr

from swarm.config import SwarmConfig
from swarm.net import schema, signedmeta
from swarm.net.access import Access
from swarm.net.allreduce.robust import OUTSIZED, outsized
from swarm.net.dht import children_die_with_us
from swarm.net.identity import Identity

logger = logging.getLogger(__name__)

OUTER_STEP_BITS = 32


@dataclass
class Group:
    group_id: bytes
    members: list[PeerID]  # same order on every member
    metas: list[dict[str, Any]]  # members' gathered metadata, same order


class GroupMeta(BaseModel):
    """What each member tells its group when it forms: checked before any of it is used."""

    round: conint(ge=0, strict=True)  # wire name of the outer step (schema.WIRE_NAMES)
    nonce: constr(regex=r"^[0-9a-f]{16}$", strict=True)
    token: confloat(ge=1.0, le=2.0**16, strict=True)
    samples: conint(ge=0, strict=True) = 0  # inner samples since the last commit: the member's weight
    numel: conint(ge=0, strict=True) = 0  # elements of the vector it averages
    base: schema.Sha256 = ""  # the state's hash (statehash.py) its pseudo-gradient starts from
    chunk: Optional[conint(ge=0, strict=True)] = None  # elements per chunk it asks for (grouping.agreed_chunk)
    client: StrictBool = False  # it cannot be dialed (swarm.client_mode): it owns no part (allreduce/layout.py)
    key: StrictBytes = b""  # the member's public key, and its signature over the rest (signedmeta.py, checked
    sig: StrictBytes = b""  # before this model is)

    class Config:
        extra = "forbid"

    @property
    def outer_step(self) -> int:
        return self.round


class NoGroup(Exception):
    """Matchmaking ended without a group; `alone` is True when nobody else showed up. `left`: a group this
    peer leaves although its groupmates may hold it (tell them, or they wait for us until they stall).
    `culprits`: the peers that made it fail, noted here (the caller leaves them out of its groups for the rest
    of the averaging attempt)."""

    def __init__(self, reason: str, alone: bool, left: Optional[Group] = None, culprits: tuple[str, ...] = ()):
        super().__init__(reason)
        self.reason, self.alone, self.left, self.culprits = reason, alone, left, culprits


def outer_step_bits(outer_step: int) -> str:
    return format(outer_step % 2**OUTER_STEP_BITS, f"0{OUTER_STEP_BITS}b")


def group_id(members: list[PeerID], metas: list[dict]) -> bytes:
    """Hash of the gathered metadata in group order: equal on every member, fresh on every attempt."""
    h = hashlib.sha256()
    for peer, meta in zip(members, metas):
        h.update(peer.to_bytes())
        h.update(MSGPackSerializer.dumps(meta))
    return h.digest()[:16]


class _NoGroupIsNoError(logging.Filter):
    """hivemind logs a full traceback (`logger.exception`) whenever a step finds no group, which reads as a
    crash; for us it is an expected outcome that `form_group` reports in one line (NoGroup)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "could not find a group" in str(record.exc_info[1]))


def _quiet_hivemind() -> None:
    averager_log = logging.getLogger("hivemind.averaging.averager")  # the forked averager inherits the filter
    if not any(isinstance(f, _NoGroupIsNoError) for f in averager_log.filters):
        averager_log.addFilter(_NoGroupIsNoError())


class _LeaderWatch:
    """A stub to a potential leader: we never ask to join one our `Access` refuses (a banned peer that leads
    would otherwise take every honest follower's attempts), and note which group it began (BEGIN_ALLREDUCE):
    a follower learns who handed it its group, to charge that leader with a forged meta (signedmeta.py)."""

    def __init__(self, stub, peer: PeerID, averager: _GroupAverager):
        self._stub, self._peer, self._began_by, self._access = stub, peer, averager.began_by, averager.access

    def __getattr__(self, name: str):
        return getattr(self._stub, name)

    async def rpc_join_group(self, request, timeout: Optional[float] = None):
        if not self._access.admits(self._peer):  # hivemind goes on to the next potential leader
            raise P2PHandlerError(f"{self._peer} is refused here: not asking to join it")
        return self._watch(await self._stub.rpc_join_group(request, timeout=timeout))

    async def _watch(self, stream):
        try:
            async for message in stream:
                if message.code == averaging_pb2.BEGIN_ALLREDUCE:
                    self._began_by[message.group_id] = self._peer
                    while len(self._began_by) > 64:  # groups begun but never averaged: forget the oldest
                        self._began_by.popitem(last=False)
                yield message
        finally:
            await stream.aclose()


class _GroupAverager(DecentralizedAverager):
    """hivemind's averager with a per-step group size (a leader starts as soon as this many peers joined)
    that, as a leader, refuses the join requests of peers its `Access` refuses and of peers whose meta they
    did not sign themselves; `step` returns {"leader": who began the group (None: we did), "gathered": ...}."""

    # hivemind asks the class, not the instance, for stubs (`get_stub`); each averager runs in a process of
    # its own, forked in `__init__`, so there the class knows its one instance (set just before the fork)
    _here: Optional[_GroupAverager] = None

    def __init__(self, *args, access: Access, prefix: str, lead: Callable[[Any], Any], **kwargs):
        self.access = access  # copied into the averager's process when it forks; bans follow by `refuse`
        self._meta_prefix = prefix
        self._lead = lead  # `hostile.Hooks.lead`: the group message we send our followers as a leader
        self.began_by: OrderedDict[bytes, PeerID] = OrderedDict()  # group id -> the leader that began it
        type(self)._here = self
        super().__init__(*args, prefix=prefix, **kwargs)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        forged = self._unsigned_join(request, context.remote_id)
        if not self.access.admits(context.remote_id) or forged:
            if forged:
                logger.warning(f"refused the join request of {context.remote_id}: {forged}")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield self._lead(response) if response.code == averaging_pb2.BEGIN_ALLREDUCE else response

    def _unsigned_join(self, request: averaging_pb2.JoinRequest, peer: PeerID) -> Optional[str]:
        """Why the meta in a join request is not `peer`'s own signed meta; None if it is."""
        try:
            meta = MSGPackSerializer.loads(MSGPackSerializer.loads(request.gather)[2])
        except Exception:  # msgpack raises several unrelated types on garbage, IndexError on a short list
            return "its join request carries unreadable metadata"
        return signedmeta.unsigned(peer, self._meta_prefix, meta)

    @classmethod
    def get_stub(cls, p2p, peer: PeerID, *, namespace: Optional[str] = None):
        stub = super().get_stub(p2p, peer, namespace=namespace)
        return stub if cls._here is None else _LeaderWatch(stub, peer, cls._here)

    async def _aggregate_with_group(self, group_info, *args, **kwargs):
        gathered = await super()._aggregate_with_group(group_info, *args, **kwargs)
        leader = self.began_by.pop(group_info.group_id, None)
        return {"leader": None if leader is None else leader.to_base58(), "gathered": gathered}

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """hivemind's, then close our replica of the DHT's p2p daemon: hivemind leaves it open, and with it the
        replica's socket file in /tmp, one more left behind by every peer that ever ran."""
        try:
            await super()._shutdown(timeout)
        finally:
            await self._p2p.shutdown()  # a replica: closes our client and removes its socket; the daemon runs on

    def refuse(self, peer_id: str, timeout: float) -> None:
        """Ban `peer_id` in the averager's process too (TimeoutError if it does not answer within `timeout`)."""
        future = MPFuture()
        self._outer_pipe.send(("_refuse", [], dict(peer_id=peer_id, future=future)))
        future.result(timeout)

    async def _refuse(self, peer_id: str, future: MPFuture) -> None:
        self.access.banned.add(peer_id)
        future.set_result(None)

    def set_target_group_size(self, size: int, timeout: float) -> None:
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result(timeout)

    @contextlib.contextmanager
    def tensors(self, timeout: float):
        """`get_tensors()`, waiting at most `timeout` s for the lock (TimeoutError): after a step that timed out,
        the averager's process may hold it for good."""
        if not self.lock_averaged_tensors.acquire(timeout=timeout):
            raise TimeoutError(f"the averager's tensors stayed locked for {timeout:g} s")
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    async def _set_target_group_size(self, size: int, future: MPFuture) -> None:
        try:  # runs in the averager's process, like hivemind's own `_set_group_bits`
            self._matchmaking.target_group_size = size
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)


class Matchmaker:
    def __init__(self, cfg: SwarmConfig, dht: hivemind.DHT, fingerprint: str, access: Optional[Access] = None,
                 identity: Optional[Identity] = None, lead: Callable[[Any], Any] = lambda message: message):
        """`identity`: the key this peer signs its metas with (default: the one `dht.start_dht` ran `dht` as);
        `lead`: what we do to the group message we send our followers as a leader (hostile.Hooks.lead)."""
        self.cfg, self.access = cfg, access or Access()
        self.identity = identity or dht.identity
        self.prefix = schema.matchmaking_prefix(cfg.run_id, fingerprint)
        self._barrier_failed: Optional[int] = None  # the last outer step whose barrier failed here
        _quiet_hivemind()
        with children_die_with_us():
            # hivemind's averager, used only to agree on a group (its all-reduce averages a token)
            self.averager = _GroupAverager(
                [torch.zeros(1)], dht, start=True,
                prefix=self.prefix,
                target_group_size=cfg.target_group_size, min_group_size=cfg.min_group_size,
                min_matchmaking_time=cfg.matchmaking_time, request_timeout=cfg.request_timeout,
                allreduce_timeout=cfg.stall_timeout, next_chunk_timeout=cfg.request_timeout,
                allow_state_sharing=False, client_mode=cfg.client_mode, shutdown_timeout=cfg.request_timeout,
                access=self.access, lead=lead,
            )
        self._refused: set[str] = set()  # bans already sent to the averager's process

    def form_group(self, outer_step: int, meta: dict[str, Any], timeout: float,
                   expected: Optional[int] = None) -> Group:
        """Meet the peers of `outer_step` (at most `timeout` s); raise NoGroup if none could be met.

        `expected`: how many peers (us included) are live at this outer step; a group closes as soon as that many
        met (capped by `target_group_size`) instead of after `matchmaking_time`.
        """
        wait = self.cfg.request_timeout
        token = float(random.randint(1, 2**16))
        # `meta` comes last so that a hostile peer's hooks can claim another outer step or token (hostile.py)
        meta = signedmeta.sign(self.identity, self.prefix, {"round": outer_step, "nonce": os.urandom(8).hex(),
                                                            "token": token, **meta})
        size = self.cfg.target_group_size if expected is None else max(2, min(expected, self.cfg.target_group_size))
        try:
            for peer in self.access.banned - self._refused:
                self.averager.refuse(peer, wait)
                self._refused.add(peer)
            self.averager.set_group_bits(outer_step_bits(outer_step), wait=False).result(wait)
            self.averager.set_target_group_size(size, wait)
            with self.averager.tensors(wait) as tensors:
                tensors[0].fill_(token)
        except TimeoutError as e:
            raise NoGroup(f"outer step {outer_step}: the matchmaking process did not answer: "
                          f"{e or f'within {wait:g} s'}", alone=False) from None
        start = time.monotonic()
        try:
            stepped = self.averager.step(gather=meta, timeout=timeout, allow_retries=False)
        except Exception as e:  # hivemind raises AllreduceException, MatchmakingException, TimeoutError...
            alone = "could not find a group" in str(e)
            raise NoGroup(f"no group for outer step {outer_step} after {time.monotonic() - start:.1f} s: {e!r}",
                          alone) from e
        if stepped is None or stepped["gathered"] is None:
            raise NoGroup(f"no group for outer step {outer_step}: the averager returned nothing", alone=False)
        members, metas = list(stepped["gathered"].keys()), list(stepped["gathered"].values())
        if len(members) < 2:
            raise NoGroup(f"outer step {outer_step}: only this peer in its group", alone=True)
        group = Group(group_id(members, metas), members, metas)
        self._check(outer_step, group, stepped["leader"], meta)
        return group

    def _check(self, outer_step: int, group: Group, leader: Optional[str], ours: dict[str, Any]) -> None:
        """Before we use a group: who led it, every admitted member's meta signed by itself and fitting ours, and
        the barrier; NoGroup naming the culprits (charged an offense here) if any of it fails."""
        members, metas = group.members, group.metas
        if leader is not None and not self.access.admits(leader):
            raise NoGroup(f"outer step {outer_step}: the group was assembled by {leader}, which this peer refuses "
                          f"({self.access.refusal(leader)})", alone=False, left=group)
        # Refused members (allowlist, bans) are left out by the caller (grouping.Offenses.exclude); their meta
        # is not read, and their barrier tokens are unknowns that must sum to something plausible.
        admitted = [self.access.admits(p) for p in members]
        forged = [(str(p), why) for p, m, ok in zip(members, metas, admitted)
                  if ok and (why := signedmeta.unsigned(p, self.prefix, m))]
        if forged:  # an honest leader checked every join (`_GroupAverager`): whoever assembled the group forged it
            culprit = leader or forged[0][0]  # we led: we checked the joins, so only a bug gets here
            reason = (f"outer step {outer_step}: the group from leader {culprit} holds metadata its members did not "
                      "sign: " + ", ".join(f"{p} ({why})" for p, why in forged))
            self.access.offense(culprit, reason)
            raise NoGroup(reason, alone=False, left=group, culprits=(culprit,))
        mine = [m for p, m in zip(members, metas) if p == self.averager.peer_id]
        if leader is not None and mine != [ours]:  # signed by us, but not what we sent for this attempt
            reason = (f"outer step {outer_step}: the group from leader {leader} holds another meta of ours than we "
                      f"sent for this attempt (a replay)" if mine
                      else f"outer step {outer_step}: leader {leader} left us out of its group")
            self.access.offense(leader, reason)
            raise NoGroup(reason, alone=False, left=group, culprits=(leader,))
        bad = [str(p) for p, m, ok in zip(members, metas, admitted) if ok and not fits(m)]
        if bad:  # signed by its member: its own words
            for peer in bad:
                self.access.offense(peer, "sent malformed matchmaking metadata")
            raise NoGroup(f"outer step {outer_step}: malformed matchmaking metadata from {', '.join(bad)}", alone=False,
                          left=group, culprits=tuple(bad))
        checked = {str(p): GroupMeta.parse_obj(m) for p, m, ok in zip(members, metas, admitted) if ok}
        for peer in outsized({p: m.samples for p, m in checked.items()}):
            self.access.note("outsized_weight", peer, f"claims {checked[peer].samples} samples, over {OUTSIZED}x its "
                                                      f"group's median: its share is capped (swarm.max_weight_share)")
        if (found := misfit(outer_step, checked, GroupMeta.parse_obj(ours))) is not None:
            reason, culprits = found
            for peer in culprits:
                self.access.offense(peer, reason)
            raise NoGroup(reason, alone=False, left=group, culprits=tuple(culprits))
        try:
            with self.averager.tensors(self.cfg.request_timeout) as tensors:
                got = float(tensors[0])
        except TimeoutError as e:
            raise NoGroup(f"outer step {outer_step}: {e}", alone=False, left=group) from None
        unknown = got * len(members) - sum(m.token for m in checked.values())  # the refused members' tokens
        lo, hi = len(members) - len(checked), (len(members) - len(checked)) * 2.0**16
        if not lo - 1e-4 * got * len(members) <= unknown <= hi + 1e-4 * got * len(members):
            if self._barrier_failed == outer_step:  # see "The barrier" above: the all-reduce's HELLOs decide now
                logger.info(f"outer step {outer_step}: the matchmaking barrier failed again; going on, the all-reduce "
                            f"checks who is there")
                return
            self._barrier_failed = outer_step
            raise NoGroup(f"a phantom group of {len(members)}: not every member took part in the matchmaking "
                          f"barrier", alone=False, left=group)

    def close(self) -> None:
        if self.averager.is_alive():
            self.averager.shutdown()
        self.averager.join(self.cfg.request_timeout)


def misfit(outer_step: int, checked: dict[str, GroupMeta], ours: GroupMeta) -> Optional[tuple[str, list[str]]]:
    """Why a group whose admitted members signed `checked` (by peer id) must be left, and who is to blame (each
    said it itself); None if it need not. A meta of an earlier outer step blames nobody: its member signed it once,
    and a leader it joined then can replay it into any later group (signedmeta.py); a later outer step's it cannot
    have signed for anyone yet but itself."""
    if other := [p for p, m in checked.items() if m.outer_step != outer_step]:
        return f"outer step {outer_step}: {', '.join(other)} sent metadata of another outer step", [
            p for p in other if checked[p].outer_step > outer_step]
    if other := [p for p, m in checked.items() if m.numel != ours.numel]:
        return (f"outer step {outer_step}: {', '.join(other)} average vectors of other sizes than our {ours.numel} "
                f"elements", other)
    return None


def fits(meta: Any) -> bool:
    """Whether `meta` is well-formed matchmaking metadata (a `GroupMeta`)."""
    try:
        GroupMeta.parse_obj(meta)
        return True
    except (ValidationError, TypeError):
        return False
