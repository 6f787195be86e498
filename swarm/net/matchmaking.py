"""Group formation with hivemind's public `DecentralizedAverager`, used only to agree on a group.

`averager.step(gather=meta)` on a 1-element tensor returns `{peer_id: meta}` in the same order on every
member (the leader's order). The all-reduce of one float that follows is a cheap barrier, and a checked
one: each member puts a random token in the tensor and in its meta, and the result must be the mean of
the gathered tokens. hivemind reports an all-reduce that missed a member as a success ("Reducer:
received 50.0% of input tensors"): a member whose groupmate had already left matchmaking (its step timed
out as the leader closed the group) got such a phantom group, and then waited out a whole
time-out for parts that never came. Now it retries at once, and tells its groupmates (`AllReduce.abandon`):
those for whom the barrier did succeed drop the group at once too, instead of waiting for this peer's
parts until they stall. The real all-reduce runs in allreduce.py.

Round tagging: the averager's group key is `{run_id}_{fingerprint}.0b{round as 32 bits}`.
- the prefix makes peers of another run, or of this run with other model/run settings, never meet;
- the group bits are set to the round before every step (`set_group_bits`; hivemind rewrites them
  after each group), so only peers of the same round meet.

Each member's meta carries a fresh random nonce, so the group id (a hash of the gathered metadata in
group order) differs on every attempt, also when the same peers retry together.

Group size: every step's target is the number of live peers at this round or still showing the one
before (their progress records, us included), capped by `target_group_size`: the leader starts as soon
as they all joined. A peer not yet visible (a newcomer) may miss the group; it then finds the swarm ahead
and downloads the state. A peer's first group waits the full matchmaking_time: peers started with it may
not have published a record yet.

A client (`swarm.client_mode`, a peer that cannot be dialed) never leads: hivemind's averager in client mode
only joins leaders, over the streams it opens to them; a group of clients alone never forms. Its meta says
`client`, so that it owns no part of the all-reduce (layout.py).

Every member's meta is untrusted: it must fit `GroupMeta` (strict types, bounded sizes) or the group is
left and the member charged an offense (access.py); a group holding a peer that `Access` refuses (not in
the allowlist, or banned) is left as well, and as a leader this peer refuses such peers' join requests.

Timeouts, all from SwarmConfig:
- `min_matchmaking_time = matchmaking_time`: how long a leader waits for followers it expects but
  that do not come (a peer that died with its record still fresh);
- `request_timeout`: a follower's wait for a leader's answer (below matchmaking_time, or leaders deadlock);
- `allreduce_timeout` (= stall_timeout) / `next_chunk_timeout`: bound hivemind's dummy all-reduce; hivemind's
  defaults are None, with which a peer killed mid-round left survivors hanging for minutes;
- `step(timeout=...)`: the caller's deadline for one attempt; `allow_retries=False`, retries are ours.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.serializer import MSGPackSerializer
from pydantic.v1 import BaseModel, StrictBool, ValidationError, confloat, conint, constr

from swarm.config import SwarmConfig
from swarm.net import schema
from swarm.net.access import Access
from swarm.net.dht import children_die_with_us

logger = logging.getLogger(__name__)

ROUND_BITS = 32


@dataclass
class Group:
    group_id: bytes
    members: list[PeerID]  # same order on every member
    metas: list[dict[str, Any]]  # members' gathered metadata, same order


class GroupMeta(BaseModel):
    """What each member tells its group when it forms: checked before any of it is used."""

    round: conint(ge=0, strict=True)
    nonce: constr(regex=r"^[0-9a-f]{16}$", strict=True)
    token: confloat(ge=1.0, le=2.0**16, strict=True)
    samples: conint(ge=0, strict=True) = 0  # inner samples since the last commit: the member's weight
    numel: conint(ge=0, strict=True) = 0  # elements of the vector it averages
    base: schema.Sha256 = ""  # hash of the global parameters its pseudo-gradient starts from
    chunk: Optional[conint(ge=0, strict=True)] = None  # elements per chunk it asks for (grouping.agreed_chunk)
    client: StrictBool = False  # it cannot be dialed (swarm.client_mode): it owns no part (layout.py)

    class Config:
        extra = "forbid"


class NoGroup(Exception):
    """Matchmaking ended without a group; `alone` is True when nobody else showed up. `left`: a group this
    peer leaves although its groupmates may hold it (tell them, or they wait for us until they stall)."""

    def __init__(self, reason: str, alone: bool, left: Optional[Group] = None):
        super().__init__(reason)
        self.reason, self.alone, self.left = reason, alone, left


def round_bits(round: int) -> str:
    return format(round % 2**ROUND_BITS, f"0{ROUND_BITS}b")


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


class _GroupAverager(DecentralizedAverager):
    """hivemind's averager with a per-step group size (a leader starts as soon as this many peers joined)
    that, as a leader, refuses the join requests of peers its `Access` refuses."""

    def __init__(self, *args, access: Access, **kwargs):
        self._access = access  # copied into the averager's process when it forks; bans follow by `refuse`
        super().__init__(*args, **kwargs)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not self._access.admits(context.remote_id):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    def refuse(self, peer_id: str) -> None:
        """Ban `peer_id` in the averager's process too."""
        future = MPFuture()
        self._outer_pipe.send(("_refuse", [], dict(peer_id=peer_id, future=future)))
        future.result()

    async def _refuse(self, peer_id: str, future: MPFuture) -> None:
        self._access.banned.add(peer_id)
        future.set_result(None)

    def set_target_group_size(self, size: int) -> None:
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result()

    async def _set_target_group_size(self, size: int, future: MPFuture) -> None:
        try:  # runs in the averager's process, like hivemind's own `_set_group_bits`
            self._matchmaking.target_group_size = size
            future.set_result(None)
        except Exception as e:
            future.set_exception(e)


class Matchmaker:
    def __init__(self, cfg: SwarmConfig, dht: hivemind.DHT, fingerprint: str, access: Optional[Access] = None):
        self.cfg, self.access = cfg, access or Access()
        _quiet_hivemind()
        with children_die_with_us():
            self._averager = _GroupAverager(
                [torch.zeros(1)], dht, start=True,
                prefix=schema.matchmaking_prefix(cfg.run_id, fingerprint),
                target_group_size=cfg.target_group_size, min_group_size=cfg.min_group_size,
                min_matchmaking_time=cfg.matchmaking_time, request_timeout=cfg.request_timeout,
                allreduce_timeout=cfg.stall_timeout, next_chunk_timeout=cfg.request_timeout,
                allow_state_sharing=False, client_mode=cfg.client_mode, shutdown_timeout=cfg.request_timeout,
                access=self.access,
            )
        self._refused: set[str] = set()  # bans already sent to the averager's process

    def form_group(self, round: int, meta: dict[str, Any], timeout: float, expected: Optional[int] = None) -> Group:
        """Meet the peers of `round` (at most `timeout` s); raise NoGroup if none could be met.

        `expected`: how many peers (us included) are live at this round; a group closes as soon as that many
        met (capped by `target_group_size`) instead of after `matchmaking_time`.
        """
        for peer in self.access.banned - self._refused:
            self._averager.refuse(peer)
            self._refused.add(peer)
        token = float(random.randint(1, 2**16))
        meta = dict(meta, round=round, nonce=os.urandom(8).hex(), token=token)
        self._averager.set_group_bits(round_bits(round))
        size = self.cfg.target_group_size if expected is None else max(2, min(expected, self.cfg.target_group_size))
        self._averager.set_target_group_size(size)
        with self._averager.get_tensors() as tensors:
            tensors[0].fill_(token)
        start = time.monotonic()
        try:
            gathered = self._averager.step(gather=meta, timeout=timeout, allow_retries=False)
        except Exception as e:  # hivemind raises AllreduceException, MatchmakingException, TimeoutError...
            alone = "could not find a group" in str(e)
            raise NoGroup(f"no group for round {round} after {time.monotonic() - start:.1f} s: {e!r}", alone) from e
        if gathered is None:
            raise NoGroup(f"no group for round {round}: the averager returned nothing", alone=False)
        members, metas = list(gathered.keys()), list(gathered.values())
        if len(members) < 2:
            raise NoGroup(f"round {round}: only this peer in its group", alone=True)
        group = Group(group_id(members, metas), members, metas)
        # Refused members (allowlist, bans) are left out by the caller (grouping.Offenses.exclude); their meta
        # is not read, and their barrier tokens are unknowns that must sum to something plausible.
        admitted = [self.access.admits(p) for p in members]
        bad = [str(p) for p, m, ok in zip(members, metas, admitted) if ok and not _fits(m)]
        if bad:
            for peer in bad:
                self.access.offense(peer, "sent malformed matchmaking metadata")
            raise NoGroup(f"round {round}: malformed matchmaking metadata from {', '.join(bad)}", alone=False,
                          left=group)
        checked = [GroupMeta.parse_obj(m) for m, ok in zip(metas, admitted) if ok]
        if (reason := misfit(round, checked, self.cfg.verify_parts)) is not None:
            raise NoGroup(reason, alone=False, left=group)
        with self._averager.get_tensors() as tensors:
            got = float(tensors[0])
        unknown = got * len(members) - sum(m.token for m in checked)  # the refused members' tokens together
        lo, hi = len(members) - len(checked), (len(members) - len(checked)) * 2.0**16
        if not lo - 1e-4 * got * len(members) <= unknown <= hi + 1e-4 * got * len(members):
            raise NoGroup(f"a phantom group of {len(members)}: not every member took part in the matchmaking "
                          f"barrier", alone=False, left=group)
        return group

    def close(self) -> None:
        if self._averager.is_alive():
            self._averager.shutdown()
        self._averager.join(self.cfg.request_timeout)


def misfit(round: int, checked: list[GroupMeta], verify_parts: bool) -> Optional[str]:
    """Why a group whose admitted members sent `checked` must be left; None if it need not."""
    if any(m.round != round for m in checked):
        return f"round {round}: a groupmate sent metadata of another round"
    if verify_parts and any(m.client for m in checked):  # no honest peer: config.py refuses the two together
        return f"round {round}: a groupmate claims to be a client, which cannot answer the audits of swarm.verify_parts"
    return None


def _fits(meta: Any) -> bool:
    try:
        GroupMeta.parse_obj(meta)
        return True
    except (ValidationError, TypeError):
        return False
