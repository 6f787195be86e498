"""A peer made of several processes (ranks): DDP inside the peer, one swarm endpoint for the outer exchange.

Launch: `torchrun --nproc-per-node K -m swarm.cli peer ...` (or `swarm peer --nproc-per-node K ...`, which
runs exactly that). Every rank builds the same model (seeded init), trains on its own slice of each batch
of the peer's data shard, and DDP averages the gradients at every inner step, so every rank holds the same
local model and computes the same pseudo-gradient. Rank 0 is the peer's one swarm endpoint: it alone joins
the DHT, averages the pseudo-gradient with the other peers, writes checkpoints and serves state. What rank
0 learns from the swarm, the other ranks learn from it (`RankAverager`):

- at every inner step, whether peers wait to average (so every rank stops at the same step);
- at the round's end, the outcome and, if it committed, the averaged pseudo-gradient: every rank then
  takes the same outer step and holds the same global parameters. With `diloco.delay` rank 0 averages in a
  background thread while every rank runs the next inner steps, and the ranks take its outcome when the round
  settles (`share_outcome`, in the training thread: the background thread runs no collective); with
  `diloco.fragments` the same holds for every fragment's exchange, mid-round ones too;
- after a resume or a state download, every tensor of rank 0's state and its position (`share_state`).

A rank that dies ends the whole peer: torchrun stops the other ranks and exits non-zero, and the swarm
sees one peer leave. The restarted peer resumes from rank 0's checkpoint or catches up like any other.

Sharded peers (FSDP2 `fully_shard`, for models that do not fit one device) are the next step: each rank
would average its own shard with the same rank of the other peers and the round would commit only if
every shard committed; not built yet.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from swarm.averaging import Averager, Download, Intake, RoundOutcome, Snapshot
from swarm.config import Config
from swarm.diloco import PseudoGradient
from swarm.errors import SwarmError, UsageError
from swarm.state import TensorSpec


class Ranks:
    """This process's place in its peer: rank, world size, local rank, and the collectives between ranks."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self._cpu_group: Any = None

    @classmethod
    def from_env(cls, environ: Optional[dict[str, str]] = None) -> Ranks:
        """From torchrun's RANK / WORLD_SIZE / LOCAL_RANK (one rank if they are not set)."""
        env = os.environ if environ is None else environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def endpoint(self) -> bool:
        """The rank that talks to the other peers."""
        return self.rank == 0

    def init(self, cfg: Config) -> None:
        """Check the config against the world size, join the process group, and put this rank on its device
        (`cuda` becomes `cuda:<local rank>`). The process group's time-out bounds how long a rank waits for
        rank 0 at a collective: raise it if rank 0's rounds (matchmaking, all-reduce, a state download) can
        take longer than 30 minutes."""
        check(cfg, self.world_size)
        if not self.distributed:
            return
        device = torch.device(cfg.diloco.device)
        if device.type == "cuda":
            cfg.diloco.device = f"cuda:{self.local_rank}"
            torch.cuda.set_device(self.local_rank)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        self._cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD

    def drain(self) -> None:
        """Every rank, once its work is done: a barrier that lets gloo's worker threads retire the finished
        collectives (freeing their tensors takes the GIL) while this thread waits without it. ProcessGroupGloo's
        destructor, which runs when its last holder (the DDP wrapper) goes, waits for those threads while holding
        the GIL: torn down with a work still retiring, a rank hung for good after writing its results (seen once,
        under load)."""
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module inner steps run: DDP over the ranks, or the model itself."""
        if not self.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel

        on_cuda = next(model.parameters()).device.type == "cuda"
        return DistributedDataParallel(model, device_ids=[self.local_rank] if on_cuda else None)

    def slice(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a peer's batch."""
        per_rank = batch.shape[0] // self.world_size
        return batch[self.rank * per_rank:(self.rank + 1) * per_rank]

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of a 0-d tensor (a loss): the peer's loss over its whole batch."""
        if not self.distributed:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self._group_of(value))
        return value / self.world_size

    def averager(self, endpoint: Optional[Averager], networked: bool) -> Averager:
        """What this rank's trainer averages with: `endpoint` itself in a one-process peer, else a RankAverager
        (rank 0 passes its endpoint, the other ranks None)."""
        return RankAverager(self, endpoint, networked) if self.distributed else endpoint

    def share(self, value: Any) -> Any:
        """Rank 0's `value` (a small picklable object) on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._cpu_group)
        return box[0]

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Overwrite `tensor` with rank 0's, in place."""
        if self.distributed:
            dist.broadcast(tensor, src=0, group=self._group_of(tensor))

    def _group_of(self, tensor: torch.Tensor) -> Any:
        return self._cpu_group if tensor.device.type == "cpu" else dist.group.WORLD


SINGLE = Ranks()


def check(cfg: Config, nproc: int) -> None:
    """UsageError (exit 2) naming the key if `nproc` ranks cannot train `cfg` here."""
    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {nproc}")
    micro = cfg.inner.micro_batch_size
    if cfg.data.batch_size % (nproc * (micro or 1)):
        by = f"inner.micro_batch_size {micro} x --nproc-per-node {nproc}" if micro else f"--nproc-per-node {nproc}"
        raise UsageError(f"data.batch_size {cfg.data.batch_size} is not divisible by {by}")
    if torch.device(cfg.diloco.device).type == "cuda":
        available = torch.cuda.device_count()
        if nproc > available:
            raise UsageError(f"--nproc-per-node {nproc} exceeds the {available} CUDA devices here "
                             f"(diloco.device {cfg.diloco.device})")


class RankAverager(Averager):
    """The `Averager` of every rank of a multi-process peer: rank 0 asks `endpoint` (the swarm), and every
    rank receives the same answer. Every method is a collective: all ranks call it at the same point."""

    def __init__(self, ranks: Ranks, endpoint: Optional[Averager], networked: bool):
        if ranks.endpoint != (endpoint is not None):
            raise ValueError("rank 0, and only rank 0, talks to the swarm")
        self.ranks, self.endpoint, self.networked = ranks, endpoint, networked

    def average(self, round: int, pseudo_grad: PseudoGradient, samples: int, out: Sequence[torch.Tensor],
                base: str = "") -> RoundOutcome:
        return self.share_outcome(self.average_in_background(round, pseudo_grad, samples, out, base), out)

    def average_in_background(self, round: int, pseudo_grad: PseudoGradient, samples: int,
                              out: Sequence[torch.Tensor], base: str = "") -> Optional[RoundOutcome]:
        """Rank 0 averages with the swarm; the other ranks have nothing to do until `share_outcome`."""
        return self.endpoint.average(round, pseudo_grad, samples, out, base) if self.endpoint else None

    def share_outcome(self, outcome: Optional[RoundOutcome], out: Sequence[torch.Tensor]) -> RoundOutcome:
        """Rank 0's outcome on every rank: its summary, then the averaged pseudo-gradient into `out` if it
        committed (every rank calls this at the same point of its training thread)."""
        if self.endpoint is not None:
            brief = dataclasses.replace(outcome, averaged=None, residual=None)
            self.ranks.share((brief, outcome.averaged is not None))
            if outcome.averaged is not None:
                for t in outcome.averaged:
                    self.ranks.broadcast(t)
            return outcome
        brief, committed = self.ranks.share(None)
        if committed:
            for t in out:
                self.ranks.broadcast(t)
        return dataclasses.replace(brief, averaged=out if committed else None)

    def others_ready(self, round: int) -> bool:
        return self.ranks.share(self.endpoint.others_ready(round) if self.endpoint else None)

    def publish_progress(self, *args, **kwargs) -> None:
        if self.endpoint is not None:
            self.endpoint.publish_progress(*args, **kwargs)

    def offer_state(self, snapshot: Snapshot) -> None:
        if self.endpoint is not None:
            self.endpoint.offer_state(snapshot)

    def fetch_state(self, intake: Intake, round: int, sha256: str, donors: Optional[list[str]] = None,
                    must: bool = False) -> Optional[Download]:
        """Rank 0 fetches; every rank gets its answer or its error. The state itself reaches the other
        ranks through `share_state`, which the trainer calls after every fetch."""
        got, error = None, None
        if self.endpoint is not None:
            try:
                got = self.endpoint.fetch_state(intake, round, sha256, donors, must)
            except SwarmError as e:
                error = str(e)
        got, error = self.ranks.share((got, error))
        if error is not None:
            raise SwarmError(error)
        return got

    def finish(self, round: int) -> None:
        if self.endpoint is not None:
            self.endpoint.finish(round)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()


def share_state(ranks: Ranks, tensors: Callable[[], dict[str, torch.Tensor]],
                destinations: Callable[[list], dict[str, torch.Tensor]], position: tuple) -> Optional[tuple]:
    """Every rank takes rank 0's state: its tensors (by name, into `destinations(specs)` on the other
    ranks) and its `position`, which is returned on every rank. None on a single-process peer."""
    if not ranks.distributed:
        return None
    mine = tensors() if ranks.endpoint else None
    specs = ranks.share([TensorSpec.of(n, t) for n, t in mine.items()] if mine is not None else None)
    targets = mine if mine is not None else destinations(specs)
    for spec in specs:
        ranks.broadcast(targets[spec.name])
    return ranks.share(position)
