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
lands before the next one starts. An exchange is swarm/train/overlap.py's `Exchange` on the fragment's tensors alone
(`delay >= 1`; on landing local += new global - resume point) or, with `delay: 0`, a blocking average and outer
step between two inner steps. With F = 1 the local model resumes from its own outer step (eager, as in
swarm/train/overlap.py); with F > 1 it goes on from where it was, as in Streaming DiLoCo: the eager jump of one
fragment while the others stay cost loss. 4 simulated peers, H=50, delay 5, 400 inner steps, eval of the
global parameters: eager 2.1127, going on 1.9483 (mix_alpha 0.5; blocking F=1 DiLoCo 2.0356).
Each fragment has its own outer step (SGD steps only the tensors that have a gradient, so its momentum slice
moves with it alone) and its own count of outer steps (`Fragment.commits`).

`diloco.mix_alpha: a` is Streaming DiLoCo's merge, local <- a * local + (1 - a) * target, at each landing. The
target is the new global parameters carried forward by the inner steps taken since the exchange started
(new global + local - resume point): with `delay: 0` exactly the paper's new global parameters; with a delay we
keep those inner steps where the paper's a = 0 drops them. a = 0 (the default) is plain DiLoCo; a = 1 never
moves the local model (its drift goes into the fragment's next pseudo-gradient). F = 1 with a = 0 is exactly
the single exchange per round of swarm/train/trainer.py.

Transactions and hashes: every exchange, mid-round ones too, is an outer step that commits the same bytes on every
member of its group or is discarded (the words: swarm/__init__.py). A discarded fragment keeps its local progress,
and its next exchange (next round) covers both. After every committed exchange the peer records the global hash it
committed and serves its state. A peer that a mid-round exchange finds behind takes the swarm's state at once,
with the inner step of the round the donor was at when it committed (the state's `inner`), and goes on from there:
its next exchange meets the others'. A round closes with its last fragment, and only then is a checkpoint
written; it holds the global parameters only, so a resumed peer restarts its local model from them at the
round's first inner step (as with `diloco.delay`), dropping the local progress of fragments since their last
exchange.

Stragglers: as with one fragment, a peer whose groupmates finished their round and wait to average ends its round
early (`round_over`), but only after the round's last mid-round exchange landed (`may_stop_early`): peers of
unequal speed realign once per round. Between, a faster peer waits for a slower one in matchmaking (at most the
matchmaking time, then it goes without it, and the slower peer takes the state at its next exchange).

Multi-process peers (--nproc-per-node > 1): every rank runs the same fragments at the same inner steps; rank 0
averages and the trainer hands its outcomes, and any state it takes, to the other ranks (swarm/train/ranks.py).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from swarm.config import ConfigError, DilocoConfig
from swarm.tensors import Buffers
from swarm.train.diloco import DiLoCo, Kept, OnNode, PseudoGradient, take
from swarm.train.sharding import NodeVector, Rows

log = logging.getLogger("swarm.fragments")


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


class Fragment:
    """Fragment `index` of `count`: tensors `indices` of a DiLoCo, seen through the attributes an `Exchange` uses
    (params, global_params, outer_grads, outer_step, ...)."""

    def __init__(self, diloco: DiLoCo, index: int, count: int, indices: Sequence[int]):
        self.diloco, self.index, self.count, self.indices = diloco, index, count, list(indices)
        self.params = [diloco.params[i] for i in self.indices]
        self.global_params = [diloco.global_params[i] for i in self.indices]
        self.commits = 0  # this fragment's outer steps in this process

    @property
    def mix_alpha(self) -> float:
        return self.diloco.mix_alpha

    def pseudo_gradient(self, residual: Optional[Sequence[torch.Tensor]] = None,
                        taken: Optional[Sequence[torch.Tensor]] = None) -> PseudoGradient:
        """global - local (or what was `taken` of it: `diloco.take`) + `residual` (shaped like this fragment's
        tensors: what the averager's `ExchangeOutcome.residual` gave for it). A sharded peer's: this rank's rows,
        without the residual (`wire` adds it, whole, on rank 0)."""
        mine = None if self.diloco.shards else residual
        if taken is not None:
            return Kept(taken, mine)
        return PseudoGradient(self.global_params, self.params, mine)

    def take(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """global - local now, per tensor, kept in `dtype` (a delayed exchange's: swarm/train/overlap.py)."""
        return take(self.global_params, self.params, dtype)

    def wire(self, pseudo_grad: PseudoGradient, out: list[torch.Tensor],
             residual: Optional[Sequence[torch.Tensor]] = None) -> tuple[PseudoGradient, list[torch.Tensor] | Buffers]:
        """What the averager reads and writes: `pseudo_grad` and `out` themselves, or on a sharded peer (every rank
        at once) the node-local files every rank wrote its rows of the pseudo-gradient into, plus `residual` on
        rank 0, and the one the average goes into (swarm/train/sharding.py). The other ranks' averager reads neither."""
        shards = self.diloco.shards
        if shards is None:
            return pseudo_grad, out
        for j, i in enumerate(self.indices):
            shards.given.write_rows(i, lambda start, end, j=j: pseudo_grad.read(j, start, end))
        finite = shards.all_true(pseudo_grad.is_finite())  # a collective: every rank's rows are written after it
        if not shards.root:
            return pseudo_grad, out
        return OnNode(shards.given.vector(self.indices), residual, finite), shards.average.vector(self.indices)

    def unwire(self, averaged: Optional[Buffers]) -> Buffers:
        """A sharded peer whose exchange committed (every rank, after rank 0 told them): this rank's rows of the
        average, in the node-local file rank 0's averager wrote it into, read a tensor at a time by the outer step
        (no copy of them held; the file is not written again before this fragment's next exchange)."""
        shards = self.diloco.shards
        if shards.root and not (isinstance(averaged, NodeVector) and averaged.file is shards.average):
            raise RuntimeError("the averager wrote the average elsewhere than into the buffers it was given")
        return Rows(shards.average, self.indices, [g.shape for g in self.global_params])

    def outer_grads(self) -> list[torch.Tensor]:
        return [torch.empty_like(g) for g in self.global_params]

    def global_sha256(self) -> str:
        """The hash of all global parameters: the base an exchange starts from."""
        return self.diloco.global_sha256()

    def own_outer_step(self, index: int, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """Where an `Exchange` of this fragment resumes the local model from, given the `pseudo_grad` it took: with
        F = 1 the outer step on it (swarm/train/overlap.py); with F > 1 the local model it was taken from
        (global - pseudo_grad), as in Streaming DiLoCo (module docstring: one fragment jumping ahead of the
        others it trains with cost loss)."""
        if self.count == 1:
            return self.diloco.own_outer_step(self.indices[index], pseudo_grad)
        g = self.global_params[index]
        return g - pseudo_grad.to(g.device, torch.float32)

    def outer_step(self, averaged: Sequence[torch.Tensor] | Buffers, keep_local: bool = False) -> None:
        """This fragment's outer step; the last fragment's closes the round."""
        self.diloco.outer_step(averaged, keep_local, self.indices, closes_round=self.index == self.count - 1)
        self.commits += 1


class Fragments:
    """One peer's fragments and their schedule: which exchanges land and start between two inner steps. A schedule
    only: the trainer runs the exchanges and decides their outcomes (swarm/train/trainer.py)."""

    def __init__(self, diloco: DiLoCo, cfg: DilocoConfig):
        groups = partition(diloco.layout.numels, cfg.fragments)  # the whole tensors' sizes, sharded or not
        self.all = [Fragment(diloco, f, cfg.fragments, g) for f, g in enumerate(groups)]
        self.last = self.all[-1]  # its exchange closes the round
        self.starts = sync_steps(cfg.inner_steps, cfg.fragments)
        self.delay = cfg.delay
        # after which inner step of a round each exchange lands: the last fragment's `delay` steps into the next
        self.lands = [s + self.delay for s in self.starts[:-1]] + [self.delay]
        if cfg.fragments > 1:
            log.info("%d fragments of %s tensors (%s elements), exchanges after inner steps %s of each round",
                     len(self.all), [len(g) for g in groups],
                     [sum(diloco.layout.numels[i] for i in g) for g in groups], self.starts)

    @property
    def streaming(self) -> bool:
        """More than one fragment: exchanges happen inside the round too."""
        return len(self.all) > 1

    def due(self, done: int) -> list[tuple[str, Fragment]]:
        """What follows inner step `done` of a round, in order: ("land", f) for a delayed exchange due to land,
        then ("start", f) for a mid-round fragment's exchange, with ("land", f) right after it when nothing delays
        it. The last fragment's exchange starts when the round ends (`Trainer`), which may be before H."""
        events = [("land", f) for f in self.all if self.delay and self.lands[f.index] == done]
        for f in self.all[:-1]:
            if self.starts[f.index] == done:
                events += [("start", f)] if self.delay else [("start", f), ("land", f)]
        return events

    def may_stop_early(self, done: int) -> bool:
        """Whether a round may end after `done` inner steps (a straggler meeting peers that wait to average):
        only once every mid-round exchange of the round has landed, so that each still covers its H steps."""
        return not self.streaming or done >= self.lands[-2]
