"""A round's exchange running behind the next round's first inner steps (`diloco.delay: tau`, in inner steps).

Blocking DiLoCo stops computing while the peers meet and average. With `delay: tau`, a peer that ends round r's
inner steps snapshots its local parameters, averages `global - snapshot` in a background thread, and goes straight
on with round r+1's inner steps from where it stands: its own progress stands in for the average it does not have
yet. After exactly tau inner steps of round r+1 (waiting there if the exchange has not finished; one exchange in
flight, never more) round r commits as in blocking DiLoCo, the same bytes on every member of the group, and the
local model is re-based onto the new global parameters,

    local <- local + (new global - snapshot)

so the tau inner steps it took meanwhile are kept, as if round r+1 had started from the new global parameters.
The outer step lands at a fixed inner step, so a run is as reproducible as a blocking one. A discarded exchange
changes nothing: the local model keeps all its progress, and the next pseudo-gradient, taken from the same global
parameters, covers both rounds. Costs: one copy of the parameters (the snapshot); the first tau inner steps of a
round start from a point that lacks the last average. Streaming DiLoCo (arXiv 2501.18512) finds the loss
hardly moves up to tau = 10 at H = 100 and advises tau <= 5.

Why this and not the "eager" variant (arXiv 2502.12996, which adds the local pseudo-gradient to the stale average
in the outer step itself): eager outer steps differ per peer, so peers would no longer hold one committed hash;
here the global parameters follow exactly the rule of blocking DiLoCo, and only the local model, which is this
peer's own business, carries the stand-in.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import torch

from swarm.averaging import Averager, RoundOutcome
from swarm.diloco import DiLoCo, PseudoGradient


class Exchange:
    """One round's averaging, started at once in a daemon thread (a peer that stops does not wait for it; every
    wait inside `Averager.average` ends on its own time-outs)."""

    def __init__(self, diloco: DiLoCo, averager: Averager, samples: int,
                 residual: Optional[Sequence[torch.Tensor]], **round_facts):
        start = time.perf_counter()
        self.round, self.samples, self.facts, self.dump = diloco.round, samples, round_facts, None
        with torch.no_grad():
            self.snapshot = [p.detach().to(g.device, torch.float32, copy=True)
                             for p, g in zip(diloco.params, diloco.global_params)]
        self.pseudo_grad = pseudo_grad = PseudoGradient(diloco.global_params, self.snapshot, residual)
        self.out = diloco.outer_grads()
        self.outcome: Optional[RoundOutcome] = None
        self.error: Optional[BaseException] = None
        self._done = threading.Event()
        base = diloco.global_sha256()

        def run() -> None:
            try:
                self.outcome = averager.average(self.round, pseudo_grad, samples, self.out, base)
            except BaseException as e:  # handed to the training thread by result()
                self.error = e
            finally:
                self._done.set()

        threading.Thread(target=run, name=f"exchange-round-{self.round + 1}", daemon=True).start()
        self.launch_s = time.perf_counter() - start  # mostly the snapshot: time the inner steps do not run

    def result(self) -> tuple[RoundOutcome, float]:
        """The outcome (re-raising what the exchange raised) and how long this call waited for it."""
        start = time.perf_counter()
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.outcome, time.perf_counter() - start
