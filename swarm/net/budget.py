"""How long a transfer may take: derived from its bytes and a floor on bandwidth, never a fixed limit.

Two knobs (SwarmConfig):
- `stall_timeout` (s): a stream that moves no byte for this long is dead (`wire.py`). Raise it if you see
  "stalled" on links that are slow but alive; lower it if dead peers hold outer steps up.
- `min_bandwidth` (bytes/s): the slowest link the swarm supports. A transfer of B bytes fails once it has
  taken `stall_timeout + B / min_bandwidth` s. Lower it if a steady but slow peer logs "not done within".

The arithmetic at scale, with the default floor of 1 MB/s and stall_timeout 30 s:
- One all-reduce moves, per member of n, its n-1 contributions to the other parts plus its own part's
  average to n-1 members: 2 (n-1)/n V bytes each way for a wire vector of V bytes. A 1.1B-parameter model
  in fp32 (V = 4.4 GB) with n = 8: 7.7 GB each way. Deadline: 30 + 7.7e9 / 1e6 s = 2.1 h. On a 1 Gbit/s
  link (125 MB/s) it takes 62 s, 2 % of its deadline; int8 (V = 1.2 GB) takes 16 s against 35 min.
- A state download (global parameters, outer momentum, the two AdamW moments: 16 B per parameter for an
  fp32 model) of 1.1B parameters is 17.6 GB: 141 s at 1 Gbit/s, deadline 4.9 h.
So both fit by construction on any link at or above the floor; a dead peer is still found within
`stall_timeout`, and a peer that trickles bytes slower than the floor within the deadline.
"""

from __future__ import annotations

import math

from swarm.config import SwarmConfig

CHUNK_ELEMENTS = 2**18
"""At most 1 MiB of fp32 per all-reduce chunk (allreduce/layout.py): small enough that a few in flight per
stream stay cheap, large enough that the per-frame cost of Python and p2pd is amortized (measured:
bench/allreduce.py)."""

OUTER_STEP_ATTEMPTS = 3
"""An outer step's deadline fits this many matchmakings and full all-reduces: the first try and two retries with the
survivors of a failure."""


def chunk_elements(stall: float, min_bandwidth: float) -> int:
    """Elements per all-reduce chunk: 2^18 (1 MiB of fp32), fewer when one chunk would take more than an
    eighth of `stall` s at `min_bandwidth`. An owner answers chunk k only once every member's chunk k arrived,
    so a member may hear nothing for a few chunks' time on a slow link; this keeps that well inside `stall`.
    A power of two, at least 2^10, so always a whole number of every codec's blocks."""
    fits = min_bandwidth * stall / 8 / 4
    return max(2**10, min(CHUNK_ELEMENTS, 2 ** int(math.log2(max(fits, 1)))))


def transfer_deadline(nbytes: int, stall: float, min_bandwidth: float) -> float:
    """Seconds a transfer of `nbytes` (the larger direction) may take in all."""
    return stall + nbytes / min_bandwidth


def outer_step_deadline(member_bytes: int, cfg: SwarmConfig) -> float:
    """Seconds one outer step may spend in matchmaking and all-reduce before it is discarded: OUTER_STEP_ATTEMPTS x
    (a matchmaking of `matchmaking_time` plus `request_timeout` of slack, and the all-reduce's deadline)."""
    per_attempt = cfg.matchmaking_time + cfg.request_timeout + transfer_deadline(member_bytes, cfg.stall_timeout,
                                                                                 cfg.min_bandwidth)
    return OUTER_STEP_ATTEMPTS * per_attempt
