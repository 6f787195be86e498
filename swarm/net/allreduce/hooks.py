"""The points where a peer's own part in an all-reduce can be changed from outside: `AllReduce` calls an
`AllReduceHooks` there, and this base class changes nothing.

Hostile peers (`hostile.Attacker`, a subclass through `hostile.Hooks`) and tests (a member that pushes too
little or too much, loses its stream, takes its results late, or watches an owner's memory) override them;
the protocol never branches on who it is.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Optional

import torch

from swarm.net.allreduce.groupstate import GroupState
from swarm.net.wire import Channel


class AllReduceHooks:
    def started(self, group: GroupState) -> None:
        """`group` starts running here (called on the event loop, before any byte moves)."""

    def checks_own(self) -> bool:
        """Whether we refuse to send a contribution of ours that is not finite (an honest peer does; without
        the check, the owners that receive it must refuse it)."""
        return True

    def contribution(self, values: torch.Tensor) -> torch.Tensor:
        """Our elements of a chunk, after our own finite check, before encoding."""
        return values

    async def push(self, group: GroupState, j: int, channel: Channel,
                   push: Callable[[Optional[int]], Awaitable[None]]) -> None:
        """Push our contribution to part j on `channel`, to its owner: `push(None)` sends every chunk of it,
        `push(k)` the first k."""
        await push(None)

    async def taking_results(self, group: GroupState, j: int) -> None:
        """Before we take part j's averages from its owner."""

    async def sending_result(self, group: GroupState, i: int, k: int, channel: Channel) -> None:
        """Before we, the owner of our part, send its chunk k's average to member i on `channel`."""

    def result(self, group: GroupState, i: int, k: int, payload: bytes) -> bytes:
        """The encoded average of our part's chunk k that we send member i (the same bytes to every member)."""
        return payload

    def audited(self, payload: bytes) -> bytes:
        """Our contribution to a chunk, encoded again, as we answer a groupmate's audit of it (audit.py)."""
        return payload

    def average(self, values: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunk `chunk` (its index in our part) of the average of the part we own, before it is encoded and
        sent."""
        return values
