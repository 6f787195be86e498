"""A round's exchange running behind the next round's first inner steps (`diloco.delay: tau`, in inner steps).

Blocking DiLoCo stops computing while the peers meet and average. With `delay: tau`, a peer that ends round r's
inner steps takes its pseudo-gradient d = global - local, averages it in a background thread, and goes on at
once with round r+1's inner steps. It resumes from the global parameters that the outer step would give if the
group's average were its own pseudo-gradient ("eager updates", arXiv 2502.12996, applied to the local model only):

    resume = OuterSGD(global, d)                      # momentum included; global and momentum stay untouched

After exactly tau inner steps of round r+1 (waiting there if the exchange has not finished; one exchange in
flight, never more) round r commits as in blocking DiLoCo, the same bytes on every member of the group, and the
local model moves by what the true average changed:

    local <- local + (new global - resume)

so the tau inner steps are kept, as if round r+1 had started from the new global parameters. The outer step lands
at a fixed inner step, so a run is as reproducible as a blocking one. A discarded exchange moves the local model
back by `(global - d) - resume`: it keeps its own progress, and the next pseudo-gradient, taken from the same
global parameters, covers both rounds.

Memory, beyond the training state: d, kept in `Averager.kept_dtype` (fp16 where the wire is lossy, as the shipped
int8 is: 2 bytes per parameter; the wire rounds it harder anyway, and resume, land and discard all read the same
kept d; fp32 where nothing rounds it, a peer alone or in-memory replicas), and the group's average in the wire's
bytes until it lands (allreduce/layout.py `EncodedAverage`: int8, 1.0625 bytes per parameter), decoded one tensor
at a time by the outer step.

Why resume from the own outer step rather than from the local model at launch: measured with 4 simulated peers on
the tiny model (bench/convergence.py settings, H=50, outer lr 0.7), eval loss at 1600 inner steps: blocking 1.5090,
own outer step 1.5057, local model at launch 1.5152 (tau=5); at 400 steps, tau=25: 2.0715 vs 2.0821 (blocking
2.0356). The eager rule of the paper puts the local term into the outer step itself, so outer steps would differ
per peer and peers would no longer hold one committed hash; here the global parameters follow blocking DiLoCo's
rule exactly and only the local model, this peer's own business, carries the stand-in.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from swarm.tensors import Buffers
from swarm.train.averaging import Averager, ExchangeOutcome

if TYPE_CHECKING:
    from swarm.train.fragments import Fragment


class Exchange:
    """One exchange of a fragment's pseudo-gradient (swarm/train/fragments.py; with one fragment, all tensors).

    Blocking (`delay` 0): averaged in the training thread when its result is asked for, at once; the local model
    stays as it is until the exchange lands. Delayed: the pseudo-gradient is taken, the average starts
    at once in a daemon thread (a peer that stops does not wait for it; every wait inside `Averager.average` ends
    on its own time-outs), and the local model resumes from its own outer step (module docstring).

    The trainer decides what an outcome means (`Trainer._settle`); an exchange only moves the parameters:
    `land` on a commit, `drop` on a discard."""

    def __init__(self, fragment: Fragment, averager: Averager, samples: int,
                 residual: Optional[Sequence[torch.Tensor]], delayed: bool, out: Sequence[torch.Tensor] | Buffers):
        start = time.perf_counter()
        self.fragment, self.averager, self.samples, self.delayed = fragment, averager, samples, delayed
        self.outer_step = fragment.diloco.outer_steps  # what the swarm keys this exchange by
        self.base = fragment.global_sha256()
        self.out = out  # the averaged pseudo-gradient lands here (a sharded peer: its rows)
        self.taken: Optional[list[torch.Tensor]] = None  # delayed: the pseudo-gradient as taken at launch
        self.outcome: Optional[ExchangeOutcome] = None
        self.error: Optional[BaseException] = None
        self._done = threading.Event()
        if not delayed:
            self.pseudo_grad, self.wire_out = fragment.wire(fragment.pseudo_gradient(residual), self.out, residual)
            self.launch_s = 0.0
            return
        with torch.no_grad():
            self.taken = fragment.take(averager.kept_dtype)
        self.pseudo_grad, self.wire_out = fragment.wire(fragment.pseudo_gradient(residual, self.taken), self.out,
                                                        residual)
        threading.Thread(target=self._average, name=f"exchange-outer-step-{self.outer_step + 1}", daemon=True).start()
        with torch.no_grad():  # the local model resumes from its own outer step (module docstring)
            for i, p in enumerate(fragment.params):
                p.copy_(self._start(i))
        self.launch_s = time.perf_counter() - start  # taking and resuming: time the inner steps do not run

    def _average(self) -> None:
        try:
            self.outcome = self.averager.average(self.outer_step, self.pseudo_grad, self.samples, self.wire_out,
                                                 self.base)
        except BaseException as e:  # handed to the training thread by result()
            self.error = e
        finally:
            self._done.set()

    def _start(self, index: int) -> torch.Tensor:
        """Where the local model resumed from at launch: the outer step on its own pseudo-gradient. Computed from
        the pseudo-gradient taken, the global parameters and the outer momentum, none of which change before it
        lands."""
        return self.fragment.own_outer_step(index, self.taken[index])

    def result(self) -> tuple[ExchangeOutcome, float]:
        """The outcome (re-raising what the exchange raised) and how long the training thread waited for it (a
        blocking exchange averages now: that time is the round's communication, not a wait)."""
        start = time.perf_counter()
        if not self.delayed:
            self._average()
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.outcome, (time.perf_counter() - start if self.delayed else 0.0)

    @torch.no_grad()
    def land(self, averaged: Sequence[torch.Tensor] | Buffers) -> None:
        """Commit: the fragment's outer step on the global parameters. Delayed: local += (1 - mix_alpha) (new global
        - where it resumed from); blocking: local <- new global (mixed with mix_alpha of itself)."""
        fragment = self.fragment
        if not self.delayed:
            fragment.outer_step(averaged)
            return
        keep = 1 - fragment.mix_alpha
        for i, p in enumerate(fragment.params):
            p.sub_(self._start(i).to(p.device, p.dtype), alpha=keep)
        fragment.outer_step(averaged, keep_local=True)
        for p, g in zip(fragment.params, fragment.global_params):
            p.add_(g.to(p.device, p.dtype), alpha=keep)
        self.taken = None  # spent: not held through the round's close (its eval, its checkpoint)

    @torch.no_grad()
    def drop(self) -> None:
        """Discard: the local model keeps its own progress (delayed: local += (global - pseudo-gradient taken) -
        where it resumed from, the local model at launch less the rounding of what was taken)."""
        if self.delayed:
            for i, (p, g) in enumerate(zip(self.fragment.params, self.fragment.global_params)):
                at_launch = g - self.taken[i].to(g.device, torch.float32)
                p.add_(at_launch.sub_(self._start(i)).to(p.device, p.dtype))
            self.taken = None
