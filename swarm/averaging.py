"""How a peer averages its pseudo-gradient with others: the interface the trainer sees, and two
network-free implementations.

- `SoloAverager`: one peer, no network; the average is its own pseudo-gradient.
- `SimAverager`: M replicas in one process (one thread each), averaged in memory behind a barrier.
  Used by tests and convergence benchmarks; the network implementation lives in `swarm.net.peer`.

Every implementation returns the same `RoundOutcome`: either the weighted mean pseudo-gradient,
identical on every member of the group, or `averaged=None` with the reason the round was discarded.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class RoundOutcome:
    averaged: Optional[list[torch.Tensor]]  # weighted mean pseudo-gradient (fp32); None: round discarded
    group_size: int = 1
    total_samples: int = 0
    bytes_sent: int = 0  # payload on the wire until average() returned: a groupmate that fetches our
    bytes_received: int = 0  # reduced part later (while we train on) is served but not counted
    comm_s: float = 0.0  # time in matchmaking and all-reduce
    behind: bool = False  # the swarm has moved past this round (or on other parameters): fetch the state
    donors: list[str] = field(default_factory=list)  # with `behind`: peer ids whose state to take
    note: str = ""  # why the round was discarded, or who averaged
    # swarm.error_feedback with a lossy codec: what this peer's contribution lost to quantization on the
    # wire (its pseudo-gradient minus what the reducers decoded), shaped like it; the trainer adds it to
    # the next round's pseudo-gradient. None: nothing was lost (or error feedback is off).
    residual: Optional[list[torch.Tensor]] = None


class Averager(ABC):
    """What the trainer needs from the swarm. The trainer never sees the DHT."""

    networked = False  # True where `fetch_state` can replace a lost or corrupt checkpoint

    @abstractmethod
    def average(self, round: int, pseudo_grad: list[torch.Tensor], samples: int, base: str = "") -> RoundOutcome:
        """Average `pseudo_grad` (weighted by `samples`) with the peers of `round`.

        `base` is the hash of the global parameters the pseudo-gradient was taken from: only peers on the
        same base may average together (a step applied to different bases would never reconcile them).
        """

    def publish_progress(self, round: int, inner_step: int, samples: int, samples_per_s: float,
                         ready: bool = False) -> None:
        """Tell the swarm how far this peer is; `ready`: its inner steps are done (no-op without a network)."""

    def others_ready(self, round: int) -> bool:
        """True when another live peer has finished its inner steps of `round` and waits to average.

        A slower peer then cuts its round short and contributes the steps it has (weighted by samples).
        """
        return False

    def offer_state(self, round: int, state: dict[str, Any]) -> None:
        """Make the just-committed state of `round` downloadable by newcomers (no-op without a network)."""

    def fetch_state(self, newer_than: int, validate: Callable[[dict], None],
                    donors: Optional[list[str]] = None) -> Optional[dict[str, Any]]:
        """Download the freshest state from a peer if the swarm is past round `newer_than`, else None.

        `validate` raises on a state that does not fit this peer (wrong shapes); that donor is skipped.
        `donors` restricts the choice to these peer ids.
        """
        return None

    def finish(self, round: int) -> None:
        """After this peer's last round: stay for peers that fell behind and need its state (no-op here)."""

    def close(self) -> None:
        pass


def weighted_mean(contributions: list[tuple[list[torch.Tensor], float]]) -> list[torch.Tensor]:
    """Sum_i w_i * g_i / sum_i w_i in fp32, accumulated in the given (fixed) order."""
    total = sum(w for _, w in contributions)
    if not total > 0:
        raise ValueError(f"total weight must be positive, got {total}")
    out = [torch.zeros_like(t, dtype=torch.float32) for t in contributions[0][0]]
    for tensors, w in contributions:
        for acc, t in zip(out, tensors):
            acc.add_(t.float(), alpha=w)
    return [acc.div_(total) for acc in out]


class SoloAverager(Averager):
    def average(self, round: int, pseudo_grad: list[torch.Tensor], samples: int, base: str = "") -> RoundOutcome:
        return RoundOutcome([t.float() for t in pseudo_grad], group_size=1, total_samples=samples, note="solo")


class SimAverager:
    """An in-memory all-reduce for M replicas running in M threads of one process.

    `SimAverager(M).member(i)` is the `Averager` of replica i. Each round is a barrier: the last
    replica to arrive computes the weighted mean (in replica order, so the result is deterministic)
    and every replica receives the same tensors.
    """

    def __init__(self, replicas: int, timeout: float = 600.0):
        self.replicas = replicas
        self.timeout = timeout
        self._gathered = threading.Barrier(replicas, action=self._reduce, timeout=timeout)
        self._released = threading.Barrier(replicas, timeout=timeout)
        self._inbox: dict[int, tuple[list[torch.Tensor], float]] = {}
        self._result: list[torch.Tensor] = []
        self._total_samples = 0

    def _reduce(self) -> None:
        ordered = [self._inbox[i] for i in sorted(self._inbox)]
        self._result = weighted_mean(ordered)
        self._total_samples = int(sum(w for _, w in ordered))
        self._inbox.clear()

    def abort(self) -> None:
        """Release every replica waiting at the barrier (they raise BrokenBarrierError)."""
        self._gathered.abort()
        self._released.abort()

    def member(self, index: int) -> Averager:
        return _SimMember(self, index)


class _SimMember(Averager):
    def __init__(self, sim: SimAverager, index: int):
        self.sim, self.index = sim, index

    def average(self, round: int, pseudo_grad: list[torch.Tensor], samples: int, base: str = "") -> RoundOutcome:
        start = time.perf_counter()
        self.sim._inbox[self.index] = (pseudo_grad, float(samples))
        self.sim._gathered.wait()
        result, total = [t.clone() for t in self.sim._result], self.sim._total_samples
        self.sim._released.wait()  # nobody reads _result once the next round starts writing it
        return RoundOutcome(result, group_size=self.sim.replicas, total_samples=total,
                            comm_s=time.perf_counter() - start, note=f"sim x{self.sim.replicas}")
