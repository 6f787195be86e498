"""How a peer averages its pseudo-gradient with others: the interface the trainer sees, and two
network-free implementations.

- `SoloAverager`: one peer, no network; the average is its own pseudo-gradient.
- `SimAverager`: M replicas in one process (one thread each), averaged in memory behind a barrier.
  Used by tests and convergence benchmarks; the network implementation lives in `swarm.net.peer`.

Every implementation returns the same `ExchangeOutcome`: either the weighted mean pseudo-gradient, written
into the `out` buffers it was given and identical on every member of the group, or `averaged=None` with
the reason the exchange was discarded. The words (round, outer step, exchange, ...): swarm/__init__.py.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from swarm.errors import SwarmError
from swarm.state.peerstate import TensorSpec
from swarm.tensors import Buffers, Deferred
from swarm.train.diloco import PseudoGradient


@dataclass
class ExchangeOutcome:
    """How one exchange ended (`Averager.average`): averaged by a group, or not, and what it cost."""

    averaged: Optional[Sequence[torch.Tensor] | Buffers]  # weighted mean pseudo-gradient (fp32); None: discarded
    group_size: int = 1
    total_samples: int = 0
    bytes_sent: int = 0  # payload on the wire until average() returned: a groupmate that fetches our
    bytes_received: int = 0  # part later (while we train on) is served but not counted
    comm_s: float = 0.0  # time in matchmaking and all-reduce
    allreduce_s: float = 0.0  # of which in the all-reduce that produced `averaged`
    behind: bool = False  # the swarm has committed more outer steps (or holds other parameters): take its state
    donors: list[str] = field(default_factory=list)  # with `behind`: peer ids whose state to take
    note: str = ""  # why the exchange was discarded, or who averaged
    # swarm.error_feedback with a lossy codec: what this peer's contribution lost to quantization on the
    # wire, shaped like it; the trainer adds it to the next round's pseudo-gradient. None: nothing was lost.
    residual: Optional[list[torch.Tensor]] = None


@dataclass(frozen=True)
class PeerStats:
    """What a peer shows to watchers of the swarm (`swarm monitor`): plain numbers, None where not known yet.
    Nothing in the swarm decides on them."""

    loss: Optional[float] = None  # training loss of the last inner step
    tokens_per_s: Optional[float] = None  # over this round's inner steps so far
    bytes_sent: int = 0  # all-reduce payload since this peer started
    bytes_received: int = 0
    eval_loss: Optional[float] = None  # held-out loss of the global parameters at `eval_round`
    eval_round: Optional[int] = None


@dataclass
class Download:
    """A state this peer took from a donor."""

    outer_step: int
    donor: str  # peer id
    bytes: int
    seconds: float
    sha256: str = ""  # the state's hash (swarm/state/statehash.py), checked against what was downloaded


@dataclass
class Snapshot:
    """What a donor serves at `outer_step` outer steps committed: live tensors, read under the `DiLoCo.version` seqlock
    (a read that sees the version move is abandoned: the donor committed again or is loading a state)."""

    outer_step: int
    sha256: str  # the state's hash (swarm/state/statehash.py), as committed
    meta: dict[str, Any]  # JSON-able scalars: schedule position, learning rates
    tensors: dict[str, torch.Tensor]  # state.shared_tensors(), in order
    version: int  # DiLoCo.version when taken
    current_version: Callable[[], int]


@dataclass
class Intake:
    """How a trainer takes a downloaded state in: `destinations(specs)` gives the tensors to write each named
    tensor into (ValueError if the state does not fit), `accept(meta, outer_steps)` applies the scalars once every
    byte arrived and the state's hash (swarm/state/statehash.py) matched the one the swarm committed at that count of
    outer steps (as the donor's commit records and the state's header say: not read from `meta`)."""

    destinations: Callable[[list[TensorSpec]], dict[str, torch.Tensor]]
    accept: Callable[[dict[str, Any], int], None]


class Averager(ABC):
    """What the trainer needs from the swarm. The trainer never sees the DHT."""

    networked = False  # True where `fetch_state` can replace a lost or corrupt checkpoint
    # what a pseudo-gradient kept through a delayed exchange is stored in (swarm/train/overlap.py): fp32 here, the
    # precision it is averaged in; a lossy wire rounds it harder anyway
    kept_dtype = torch.float32

    @abstractmethod
    def average(self, outer_step: int, pseudo_grad: PseudoGradient, samples: int,
                out: Sequence[torch.Tensor] | Buffers, base: str = "") -> ExchangeOutcome:
        """Average `pseudo_grad` (weighted by `samples`) with the peers that committed `outer_step` outer steps,
        into `out` (tensors, or buffers written by span: a sharded peer's rank 0 gives a node-local file's).

        `base` is the state's hash (swarm/state/statehash.py) the pseudo-gradient was taken from: only peers on the
        same base may average together (a step applied to different bases would never reconcile them).
        With `diloco.fragments` F > 1, `pseudo_grad` covers one fragment's tensors (swarm/train/fragments.py).
        """

    def result_buffers(self, shapes: Sequence[torch.Size]) -> Sequence[torch.Tensor] | Buffers:
        """Where `average` should write an average of tensors shaped `shapes`: fp32 tensors here; a networked
        averager may keep it in its own form until read (`Buffers.each`)."""
        return [torch.empty(s) for s in shapes]

    def publish_progress(self, outer_step: int, inner_step: int, samples: int, samples_per_s: float,
                         ready: bool = False, sha256: str = "", stats: Optional[PeerStats] = None) -> None:
        """Tell the swarm how far this peer is; `ready`: its inner steps are done (no-op without a network).
        `stats`: what watchers see; None keeps the last ones given."""

    def round_over(self, outer_step: int) -> bool:
        """True when this peer's round at `outer_step` should end now: another live peer at `outer_step` finished
        its round's inner steps and waits to average (a slower peer cuts its round short and contributes the steps
        it has, weighted by samples), or the swarm committed past `outer_step` (a peer that finished taking a state
        as the others committed the next: its exchange finds it behind and takes the swarm's state at once, rather
        than after a round of inner steps that no group would average)."""
        return False

    def offer_state(self, snapshot: Snapshot) -> None:
        """Serve `snapshot` to newcomers from now on (no-op without a network)."""

    def fetch_state(self, intake: Intake, outer_step: int, sha256: str, donors: Optional[list[str]] = None,
                    must: bool = False) -> Optional[Download]:
        """Take the swarm's state into `intake` if the swarm committed more outer steps than `outer_step`, or
        holds another hash than `sha256` at it (from `donors` if given), or whatever it holds with `must` (our own
        model went bad). Returns what was taken, None if there was nothing to take; SwarmError if there
        was but no peer could give it: a peer never trains on from a state the swarm has left behind."""
        if must:
            raise SwarmError("there is no peer to take a state from (this peer runs without a swarm)")
        return None

    def finish(self, outer_step: int, sha256: str) -> Optional[list[str]]:
        """After this peer's last round (`outer_step` outer steps, global parameters `sha256`): stay for peers
        that need its state; the donors of the swarm's state if the swarm committed another hash there (the
        end of a run agrees: the trainer takes it). Nothing to stay for here."""
        return None

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
    def result_buffers(self, shapes: Sequence[torch.Size]) -> Deferred:
        """The average is our own pseudo-gradient: read by the outer step itself, never copied."""
        return Deferred(shapes)

    def average(self, outer_step: int, pseudo_grad: PseudoGradient, samples: int,
                out: Sequence[torch.Tensor] | Buffers, base: str = "") -> ExchangeOutcome:
        Buffers.of(out).fill(pseudo_grad.read)
        return ExchangeOutcome(out, group_size=1, total_samples=samples, note="solo")


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

    def average(self, outer_step: int, pseudo_grad: PseudoGradient, samples: int, out: Sequence[torch.Tensor],
                base: str = "") -> ExchangeOutcome:
        start = time.perf_counter()
        self.sim._inbox[self.index] = (pseudo_grad.tensors(), float(samples))
        self.sim._gathered.wait()
        for o, r in zip(out, self.sim._result):
            o.copy_(r)
        total = self.sim._total_samples
        self.sim._released.wait()  # nobody reads _result once the next round starts writing it
        return ExchangeOutcome(out, group_size=self.sim.replicas, total_samples=total,
                            comm_s=time.perf_counter() - start, note=f"sim x{self.sim.replicas}")
