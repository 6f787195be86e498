"""After a peer's last outer step: stay while live peers need its state; take the swarm's if the end of the run
disagrees.

`linger` serves the final state (the state server keeps running meanwhile) while live peers need it, at most
`swarm.linger_time` s, and returns the donors of the swarm's state where it committed another hash than ours at
our last outer step (the end of a run agrees: the trainer takes it).

Peers need it while they are at earlier outer steps (a failed all-reduce, a slow machine: they learn it only
after their next matchmaking, and with every peer ahead gone they would find no donor), or at ours on a hash the
quorum rule (policy.py) outvotes: a last outer step that ended split between two groups, whose losing side takes the
winner's state. Peers that finished announce it (a record at their final outer step), so in a swarm where nobody
needs us this returns at once. A client (`swarm.client_mode`) serves nothing; it still takes the swarm's state if
it is outvoted. SwarmError, naming both hashes, if the swarm still holds another hash when the time is up and
nobody serves it.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from hivemind.utils.timed_storage import get_dht_time

from swarm.config import SwarmConfig, live_window
from swarm.errors import SwarmError
from swarm.net import policy
from swarm.net.records import Records

logger = logging.getLogger("swarm.net.peer")  # what the peer does at the end of its run, in its log


def linger(records: Records, cfg: SwarmConfig, peer_id: str, outer_step: int, sha256: str) -> Optional[list[str]]:
    """Serve while live peers need our state (module docstring); the donors of the swarm's state if it committed
    another hash than `sha256` at `outer_step`, else None."""
    deadline, waiting_for, position = time.monotonic() + cfg.linger_time, None, None
    while time.monotonic() < deadline:
        position = records.assess(outer_step, sha256)
        if position.verdict in (policy.Verdict.BEHIND, policy.Verdict.DIVERGED) and position.donors:
            logger.info(f"finished at outer step {outer_step} on {sha256[:12]}, but {position.note}: "
                        f"taking the swarm's state")
            return list(position.donors)
        outvoted = position.verdict in (policy.Verdict.BEHIND, policy.Verdict.DIVERGED)
        ours = position.swarm_outer_step == outer_step and position.swarm_sha256 == sha256  # the swarm's hash
        now, window = get_dht_time(), live_window(cfg)
        peers = records.read_peers()  # None: unreadable, which is no sign that nobody needs us
        needing = None if peers is None else sorted(
            r.name for r in peers if r.peer_id != peer_id and policy.is_live(r, now, window)
            and (r.outer_step < outer_step or (ours and r.outer_step == outer_step and r.sha256 not in ("", sha256))))
        if not outvoted and (needing == [] or cfg.client_mode):
            return None
        if needing and needing != waiting_for:
            logger.info(f"finished at outer step {outer_step}; serving the state to peers that need it: {needing}")
            waiting_for = needing
        time.sleep(max(0.0, min(cfg.progress_interval, 1.0, deadline - time.monotonic())))  # poll
    if position is not None and outvoted:
        raise SwarmError(f"the run ended with this peer on {sha256[:12]} at outer step {outer_step}, and the swarm "
                         f"committed {(position.swarm_sha256 or '?')[:12]} at outer step {position.swarm_outer_step}, "
                         f"which no peer served within {cfg.linger_time:g} s (swarm.linger_time)")
    logger.warning(f"stopped serving the state after {cfg.linger_time:g} s (swarm.linger_time); "
                   f"still needed by: {waiting_for}")
    return None
