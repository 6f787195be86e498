"""A round's exchange running behind the next round's first inner steps (`diloco.delay: tau`, in inner steps).

Blocking DiLoCo stops computing while the peers meet and average. With `delay: tau`, a peer that ends round r's
inner steps snapshots its local parameters, averages `global - snapshot` in a background thread, and goes on at
once with round r+1's inner steps. It resumes from the global parameters that the outer step would give if the
group's average were its own pseudo-gradient ("eager updates", arXiv 2502.12996, applied to the local model only):

    resume = OuterSGD(global, global - snapshot)      # momentum included; global and momentum stay untouched

After exactly tau inner steps of round r+1 (waiting there if the exchange has not finished; one exchange in
flight, never more) round r commits as in blocking DiLoCo, the same bytes on every member of the group, and the
local model moves by what the true average changed:

    local <- local + (new global - resume)

so the tau inner steps are kept, as if round r+1 had started from the new global parameters. The outer step lands
at a fixed inner step, so a run is as reproducible as a blocking one. A discarded exchange moves the local model
back by `snapshot - resume`: it keeps its own progress, and the next pseudo-gradient, taken from the same global
parameters, covers both rounds. Cost: one copy of the parameters (the snapshot).

Why resume from the own outer step rather than from the snapshot: measured with 4 simulated peers on the tiny
model (bench/convergence.py settings, H=50, outer lr 0.7), eval loss at 1600 inner steps: blocking 1.5090, own
outer step 1.5057, snapshot 1.5152 (tau=5); at 400 steps, tau=25: 2.0715 vs 2.0821 (blocking 2.0356). The eager
rule of the paper puts the local term into the outer step itself, so outer steps would differ per peer and peers
would no longer hold one committed hash; here the global parameters follow blocking DiLoCo's rule exactly and only
the local model, this peer's own business, carries the stand-in.
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
    wait inside `Averager.average` ends on its own time-outs). `diloco` may be one fragment of the parameters
    (swarm/fragments.py `Fragment`); its `round` is then the fragment's exchange index."""

    def __init__(self, diloco: DiLoCo, averager: Averager, samples: int,
                 residual: Optional[Sequence[torch.Tensor]], **round_facts):
        start = time.perf_counter()
        self.round, self.samples, self.facts, self.dump = diloco.round, samples, round_facts, None
        with torch.no_grad():
            self.snapshot = [p.detach().to(g.device, torch.float32, copy=True)
                             for p, g in zip(diloco.params, diloco.global_params)]
        self.pseudo_grad = pseudo_grad = PseudoGradient(diloco.global_params, self.snapshot, residual)
        self.averager, self.out = averager, diloco.outer_grads()  # the trainer frees `out` once the round closed
        self.outcome: Optional[RoundOutcome] = None
        self.error: Optional[BaseException] = None
        self._done = threading.Event()
        base = diloco.global_sha256()

        def run() -> None:
            try:
                self.outcome = averager.average_in_background(self.round, pseudo_grad, samples, self.out, base)
            except BaseException as e:  # handed to the training thread by result()
                self.error = e
            finally:
                self._done.set()

        threading.Thread(target=run, name=f"exchange-round-{self.round + 1}", daemon=True).start()
        with torch.no_grad():  # the local model resumes from its own outer step (module docstring)
            for i, p in enumerate(diloco.params):
                p.copy_(self._start(diloco, i))
        self.launch_s = time.perf_counter() - start  # snapshot and resume point: time the inner steps do not run

    def _start(self, diloco: DiLoCo, index: int) -> torch.Tensor:
        """Where the local model resumed from at launch: the outer step on its own pseudo-gradient. Computed from
        the snapshot, the global parameters and the outer momentum, none of which change before the round closes."""
        return diloco.own_outer_step(index, self.snapshot[index])

    @torch.no_grad()
    def land(self, diloco: DiLoCo, averaged: Sequence[torch.Tensor]) -> None:
        """Commit: the outer step on the global parameters, local += (1 - mix_alpha) (new global - where it
        resumed from); mix_alpha 0 (the default) takes the group's step fully."""
        keep = 1 - diloco.mix_alpha
        for i, p in enumerate(diloco.params):
            p.sub_(self._start(diloco, i).to(p.device, p.dtype), alpha=keep)
        diloco.outer_step(averaged, keep_local=True)
        for p, g in zip(diloco.params, diloco.global_params):
            p.add_(g.to(p.device, p.dtype), alpha=keep)

    @torch.no_grad()
    def drop(self, diloco: DiLoCo) -> None:
        """Discard: the local model keeps its own progress, local += snapshot - where it resumed from."""
        for i, p in enumerate(diloco.params):
            p.add_((self.snapshot[i] - self._start(diloco, i)).to(p.device, p.dtype))

    def result(self) -> tuple[RoundOutcome, float]:
        """The outcome (re-raising what the exchange raised) and how long this call waited for it. Called in
        the training thread: a multi-process peer's ranks take rank 0's outcome here (`share_outcome`)."""
        start = time.perf_counter()
        self._done.wait()
        if self.error is not None:
            raise self.error
        waited = time.perf_counter() - start
        self.outcome = self.averager.share_outcome(self.outcome, self.out)
        return self.outcome, waited
