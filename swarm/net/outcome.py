"""One call of `SwarmAverager.average` (peer.py): what it was given, its bounds, and the outcomes it can end
in: averaged with a group, alone, behind the swarm, or discarded at its deadline."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from swarm.net.allreduce import WireLayout
from swarm.net.matchmaking import Group
from swarm.net.wire import Traffic
from swarm.tensors import Buffers
from swarm.train.averaging import ExchangeOutcome
from swarm.train.diloco import PseudoGradient


@dataclass
class Averaging:
    """One call of `average`: what it was given, its bounds, and why its last attempt failed."""

    outer_step: int
    pseudo_grad: PseudoGradient
    samples: int
    out: Sequence[torch.Tensor] | Buffers
    base: str
    full: WireLayout  # the whole vector, one owner: its size and wire bytes
    meta: dict  # our matchmaking metadata
    start: float = field(default_factory=time.monotonic)
    deadline: float = 0.0  # budget.outer_step_deadline from `start`
    residual: Optional[list[torch.Tensor]] = None  # swarm.error_feedback with a lossy codec
    reason: str = "the outer step's deadline is too short for one attempt"
    expected: Optional[int] = None  # the group size the records led the last matchmaking attempt to wait for

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def behind(self, donors: list[str], note: str) -> ExchangeOutcome:
        """The swarm moved past us or holds other parameters: take its state (from `donors`), average nothing."""
        return ExchangeOutcome(None, comm_s=self.elapsed(), behind=True, donors=donors, note=note)

    def alone(self) -> ExchangeOutcome:
        """Our own pseudo-gradient as the outer step's average."""
        Buffers.of(self.out).fill(self.pseudo_grad.read)
        return ExchangeOutcome(self.out, total_samples=self.samples, comm_s=self.elapsed(), note="alone")

    def averaged(self, group: Group, traffic: Traffic, allreduce_s: float) -> ExchangeOutcome:
        """The group's average, in `out` on every member."""
        return ExchangeOutcome(self.out, group_size=len(group.members), residual=self.residual,
                            total_samples=sum(int(m.get("samples", 0)) for m in group.metas),
                            bytes_sent=traffic.sent, bytes_received=traffic.received, comm_s=self.elapsed(),
                            allreduce_s=allreduce_s, note=f"group of {len(group.members)}")

    def discarded(self) -> ExchangeOutcome:
        return ExchangeOutcome(None, comm_s=self.elapsed(),
                            note=f"outer step {self.outer_step + 1} discarded after {self.elapsed():.0f} s "
                                 f"(the outer step's deadline, budget.outer_step_deadline): {self.reason}")
