"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): the parameters in F fragments, exchanged in turn.

`diloco.fragments: F` splits the parameter tensors, in the model's order, into F contiguous fragments balanced by
size (`partition`: each cut goes at the tensor boundary nearest to an equal share of the elements, every fragment
keeps at least one tensor). The model's order runs embeddings (tied to the head in our Llama), layer 0 .. layer
L-1, final norm, so a fragment is a run of consecutive layers; a cut may fall between two tensors of one layer.
Each of a round's H inner steps belongs to the same schedule on every peer:

    fragment f starts its exchange after inner step  s_f = (f + 1) * H // F  of the round   (s_{F-1} = H)
    and lands it after inner step  s_f + delay  (for the last fragment: `delay` steps into the next round)

so F exchanges of ~1/F of the bytes travel per round instead of one, each fragment still gets H inner steps
between its exchanges, and `0 <= delay < H // F` (checked at load) keeps one exchange in flight at a time: each
lands before the next one starts. An exchange is swarm/overlap.py's `Exchange` on the fragment's tensors alone
(`delay >= 1`; on landing local += new global - resume point) or, with `delay: 0`, a blocking average and outer
step between two inner steps. With F = 1 the local model resumes from its own outer step (eager, as in
swarm/overlap.py); with F > 1 it goes on from where it was, as in Streaming DiLoCo: the eager jump of one
fragment while the others stay cost loss. 4 simulated peers, H=50, delay 5, 400 inner steps, eval of the
global parameters: eager 2.1127, going on 1.9483 (mix_alpha 0.5; blocking F=1 DiLoCo 2.0356).
Each fragment has its own outer step (SGD steps only the tensors that have a gradient, so its momentum slice
moves with it alone) and its own count of outer steps (`Fragment.commits`).

`diloco.mix_alpha: a` is Streaming DiLoCo's merge, local <- a * local + (1 - a) * target, at each landing. The
target is the new global parameters carried forward by the inner steps taken since the exchange started
(new global + local - resume point): with `delay: 0` exactly the paper's new global parameters; with a delay we
keep those inner steps where the paper's a = 0 drops them. a = 0 (the default) is plain DiLoCo; a = 1 never
moves the local model (its drift goes into the fragment's next pseudo-gradient). F = 1 with a = 0 is exactly
the single exchange per round of swarm/trainer.py.

Transactions and hashes: an exchange commits the same bytes on every member of its group or is discarded; a
discarded fragment keeps its local progress, and its next exchange (next round) covers both. Every committed
exchange is an outer step (`DiLoCo.outer_steps`, which counts them on any fragment; `DiLoCo.round` counts those
that closed a round), and a peer's place in the swarm is its count of outer steps: the averager keys an exchange
by it (`Averager.average`'s `round`), and over a network the progress records, commit records, state offers and
downloads speak of it wherever they say "round" (swarm/net). With F = 1 it is the round itself. So after every
committed exchange, mid-round ones too, the peer records the global hash it committed and serves its state, and
peers at one count of outer steps hold one hash, or the minority takes the majority's state, as whole rounds do.
A peer that learns from a mid-round exchange that it is behind takes the swarm's state at once, with the inner
step of the round the donor was at when it committed (the state's `inner`), and goes on from there: its next
exchange meets the others'. A round closes with its last fragment, and only then is a checkpoint written; it
holds the global parameters only, so a resumed peer restarts its local model from them at the round's first
inner step (as with `diloco.delay`), dropping the local progress of fragments since their last exchange.

Stragglers: as with one fragment, a peer whose groupmates finished their round and wait to average ends its round
early (`others_ready`), but only after the round's last mid-round exchange landed (`may_stop_early`): peers of
unequal speed realign once per round. Between, a faster peer waits for a slower one in matchmaking (at most the
matchmaking time, then it goes without it, and the slower peer takes the state at its next exchange).

Multi-process peers (--nproc-per-node > 1): every rank runs the same fragments at the same inner steps; rank 0
averages, and its outcomes, mid-round ones too, and any state a mid-round exchange makes it take (with its
position: round, step, outer steps, inner step) reach the other ranks in the training thread (swarm/ranks.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from swarm.averaging import Averager, RoundOutcome
from swarm.config import ConfigError, DilocoConfig
from swarm.diloco import DiLoCo, PseudoGradient
from swarm.history import RoundRecord
from swarm.overlap import Exchange

log = logging.getLogger("swarm.fragments")
_TOTALS = ("comm_s", "allreduce_s", "wait_s", "bytes_sent", "bytes_received")  # RoundRecord fields summed


def partition(numels: Sequence[int], parts: int) -> list[list[int]]:
    """Tensor indices of `parts` contiguous fragments of tensors sized `numels`, balanced by elements: cut k goes
    at the boundary whose running total is nearest k/parts of all elements (ties: the earlier boundary)."""
    n = len(numels)
    if not 1 <= parts <= n:
        raise ConfigError(f"diloco.fragments {parts} must be in [1, {n}]: the model has {n} parameter tensors")
    running, total = [0], sum(numels)
    for k in numels:
        running.append(running[-1] + k)
    bounds = [0]
    for k in range(1, parts):  # fragment k-1 is tensors [bounds[-1], cut); leave one tensor per later fragment
        cuts = range(bounds[-1] + 1, n - (parts - k) + 1)
        bounds.append(min(cuts, key=lambda cut: abs(parts * running[cut] - k * total)))
    bounds.append(n)
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def sync_steps(inner_steps: int, fragments: int) -> list[int]:
    """The inner step of a round after which each fragment's exchange starts (the last one: the round's end)."""
    return [(f + 1) * inner_steps // fragments for f in range(fragments)]


@dataclass
class TrainerHooks:
    """What the fragments ask of the trainer they run in."""

    before_change: Callable[[], None]  # the global parameters change next: settle a checkpoint still reading them
    note: Callable[[dict], None]  # a history event
    catch_up: Callable[[Optional[list[str]]], object]  # take the swarm's state (from these donors if given)
    committed: Callable[[], None]  # a mid-round exchange committed: record and serve the state it made


class Fragment:
    """Fragment `index` of `count`: tensors `indices` of a DiLoCo, seen through the attributes `Exchange` and the
    trainer's round close use (params, global_params, round, outer_grads, outer_step, ...)."""

    def __init__(self, diloco: DiLoCo, index: int, count: int, indices: Sequence[int]):
        self.diloco, self.index, self.count, self.indices = diloco, index, count, list(indices)
        self.params = [diloco.params[i] for i in self.indices]
        self.global_params = [diloco.global_params[i] for i in self.indices]
        self.commits = 0  # this fragment's outer steps in this process

    @property
    def round(self) -> int:
        """What the averager keys this exchange by: the outer steps committed so far (module docstring)."""
        return self.diloco.outer_steps

    @property
    def mix_alpha(self) -> float:
        return self.diloco.mix_alpha

    def pseudo_gradient(self, residual: Optional[Sequence[torch.Tensor]] = None) -> PseudoGradient:
        mine = None if residual is None else [residual[i] for i in self.indices]
        return PseudoGradient(self.global_params, self.params, mine)

    def outer_grads(self) -> list[torch.Tensor]:
        return [torch.empty_like(g) for g in self.global_params]

    def global_sha256(self) -> str:
        """The hash of all global parameters: the base an exchange starts from."""
        return self.diloco.global_sha256()

    def own_outer_step(self, index: int, local: torch.Tensor) -> torch.Tensor:
        """Where an `Exchange` of this fragment resumes the local model from: with F = 1 the outer step on its own
        pseudo-gradient (swarm/overlap.py); with F > 1 the local model itself, as in Streaming DiLoCo (module
        docstring: one fragment jumping ahead of the others it trains with cost loss)."""
        if self.count == 1:
            return self.diloco.own_outer_step(self.indices[index], local)
        return local.to(self.global_params[index].device, torch.float32)

    def outer_step(self, averaged: Sequence[torch.Tensor], keep_local: bool = False) -> None:
        """This fragment's outer step; the last fragment's closes the round."""
        self.diloco.outer_step(averaged, keep_local, self.indices, closes_round=self.index == self.count - 1)
        self.commits += 1


class Fragments:
    """One peer's fragments and their schedule. The last fragment's exchange is the round's own (the trainer
    closes the round with it, `boundary`); the others start and land between the round's inner steps here."""

    def __init__(self, diloco: DiLoCo, cfg: DilocoConfig, averager: Averager, trainer: TrainerHooks):
        groups = partition([p.numel() for p in diloco.params], cfg.fragments)
        self.all = [Fragment(diloco, f, cfg.fragments, g) for f, g in enumerate(groups)]
        self.boundary = self.all[-1]
        self.starts = sync_steps(cfg.inner_steps, cfg.fragments)
        self.delay, self.averager = cfg.delay, averager
        self.trainer = trainer
        self.samples = [0] * len(self.all)  # per mid-round fragment: samples its next pseudo-gradient covers
        self.pending: Optional[tuple[Fragment, Exchange, int]] = None  # in flight, lands after inner step [2]
        self.totals = dict.fromkeys(_TOTALS, 0.0)  # of the mid-round exchanges since the last round closed
        if cfg.fragments > 1:
            log.info("%d fragments of %s tensors (%s elements), exchanges after inner steps %s of each round",
                     len(self.all), [len(g) for g in groups],
                     [sum(diloco.params[i].numel() for i in g) for g in groups], self.starts)

    @property
    def streaming(self) -> bool:
        """More than one fragment: exchanges happen inside the round too."""
        return len(self.all) > 1

    def may_stop_early(self, done: int) -> bool:
        """Whether a round may end after `done` inner steps (a straggler meeting peers that wait to average):
        only once every mid-round exchange of the round has landed, so that each still covers its H steps."""
        return not self.streaming or (self.pending is None and done >= self.starts[-2] + self.delay)

    def restart(self) -> None:
        """The local model was reset to the global parameters (resumed or downloaded): no local progress, and no
        exchange in flight (a state is taken only once the exchange that found us behind has returned)."""
        self.samples = [0] * len(self.all)
        self.pending = None

    def after_inner_step(self, done: int, samples: int) -> float:
        """`done` inner steps of this round were taken, the last on `samples` samples: land the mid-round
        exchange due now, start the one due now. Returns the seconds this took (the inner steps stood still).
        An exchange that finds this peer behind takes the swarm's state: the trainer's inner step moves."""
        start = time.perf_counter()
        self.samples = [s + samples for s in self.samples]
        if self.pending is not None and done == self.pending[2]:
            pending, self.pending = self.pending, None
            if not self._settle(*pending[:2]):
                return time.perf_counter() - start
        for fragment in self.all[:-1]:
            if done != self.starts[fragment.index]:
                continue
            f = fragment.index
            if self.delay:
                self.pending = (fragment, Exchange(fragment, self.averager, self.samples[f], None), done + self.delay)
                continue
            out = fragment.outer_grads()
            outcome = self.averager.average(fragment.round, fragment.pseudo_gradient(), self.samples[f], out,
                                            fragment.global_sha256())
            self._count(outcome)
            if outcome.averaged is not None:
                self.trainer.before_change()
                fragment.outer_step(outcome.averaged)
                self.samples[f] = 0
                self.trainer.committed()
            elif not self._discarded(fragment, outcome):
                break
        return time.perf_counter() - start

    def _settle(self, fragment: Fragment, exchange: Exchange) -> bool:
        """Land or drop the exchange in flight; False if it found this peer behind (the state was taken)."""
        outcome, wait_s = exchange.result()
        self._count(outcome, wait_s)
        if outcome.averaged is not None:
            self.trainer.before_change()
            exchange.land(fragment, outcome.averaged)
            self.samples[fragment.index] -= exchange.samples  # what the inner steps since its start add stays
            self.trainer.committed()
            return True
        exchange.drop(fragment)
        return self._discarded(fragment, outcome)

    def _count(self, outcome: RoundOutcome, wait_s: float = 0.0) -> None:
        for key, value in [("comm_s", outcome.comm_s), ("allreduce_s", outcome.allreduce_s), ("wait_s", wait_s),
                           ("bytes_sent", outcome.bytes_sent), ("bytes_received", outcome.bytes_received)]:
            self.totals[key] += value

    def fold_into(self, record: RoundRecord) -> None:
        """Add the mid-round exchanges since the last round closed to the record of the round closing now."""
        for key, value in self.totals.items():
            setattr(record, key, type(getattr(record, key))(getattr(record, key) + value))
        self.totals = dict.fromkeys(_TOTALS, 0.0)

    def _discarded(self, fragment: Fragment, outcome: RoundOutcome) -> bool:
        """A mid-round exchange that did not commit: behind the swarm, take its state (False); else keep the
        fragment's local progress for its next exchange (True)."""
        if outcome.behind:
            log.warning("round %d: fragment %d: %s", fragment.diloco.round + 1, fragment.index, outcome.note)
            self.trainer.catch_up(outcome.donors or None)
            return False
        log.warning("round %d: fragment %d's exchange discarded (%s): keeping its local progress for the next one",
                    fragment.diloco.round + 1, fragment.index, outcome.note)
        self.trainer.note({"event": "fragment_discarded", "time": time.time(), "round": fragment.diloco.round,
                           "fragment": fragment.index, "note": outcome.note})
        return True
