"""A peer made of several processes (ranks): DDP inside the peer, one swarm endpoint for the outer exchange.

Launch: `swarm peer --nproc-per-node K ...` (peers/launch.py forks the K ranks with torchrun's environment), or
`torchrun --nproc-per-node K -m swarm.cli peer ...`. Every rank builds the same model (seeded init), trains on its
own slice of each batch of the peer's data shard, and DDP averages the gradients at every inner step, so every rank
holds the same local model and computes the same pseudo-gradient. Rank 0 is the peer's one swarm endpoint: it alone
joins the DHT, averages the pseudo-gradient with the other peers, writes checkpoints and serves state. What rank 0
learns from the swarm, the other ranks learn from it, through collectives the trainer calls at the same points of
every rank's training thread (the other ranks average with a `Follower`, which never talks):

- at every inner step, whether peers wait to average (`share`: every rank stops at the same step);
- where an exchange settles (`Trainer._settle`), its outcome and, if it committed, the averaged pseudo-gradient
  (`share_outcome`): every rank then takes the same outer step and holds the same global parameters. A delayed
  exchange averages in a background thread on rank 0, which runs no collective;
- a state fetched from the swarm, or its failure (`answer`), then every tensor of rank 0's state and its
  position, after a resume or a download (`share_state`).

A rank that dies ends the whole peer: the launcher (or torchrun) stops the other ranks and exits non-zero,
and the swarm sees one peer leave. The restarted peer resumes from rank 0's checkpoint or catches up like any other.

Sharded peers (`inner.parallel: fsdp`, for models that do not fit one device): FSDP2 instead of DDP, and each
rank holds only its rows of the outer state; rank 0 stays the one endpoint, and the pseudo-gradient reaches it
and the average leaves it through node-local files, chunk by chunk (swarm/train/sharding.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from swarm.config import Config
from swarm.errors import SwarmError, UsageError
from swarm.state.peerstate import Position, TensorSpec
from swarm.tensors import Buffers
from swarm.train.averaging import Averager, Download, ExchangeOutcome, Intake
from swarm.train.diloco import PseudoGradient


class Ranks:
    """This process's place in its peer: rank, world size, local rank, and the collectives between ranks."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self._cpu_group: Any = None

    @classmethod
    def from_env(cls, environ: Optional[dict[str, str]] = None) -> Ranks:
        """From the launcher's (or torchrun's) RANK / WORLD_SIZE / LOCAL_RANK (one rank if they are not set)."""
        env = os.environ if environ is None else environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def cpu_group(self) -> Any:
        """The gloo process group over the ranks (CPU tensors and small objects), once `init` ran."""
        return self._cpu_group

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
        """Every rank, once its work is done: a barrier, so that no rank leaves while another still needs it in a
        collective. The process group is never torn down: the rank's process ends with `peers.launch.exit_rank`
        (ProcessGroupGloo's destructor deadlocks; see there)."""
        if self.distributed:
            dist.barrier()


    def wrap(self, model: torch.nn.Module, sharded: bool = False) -> torch.nn.Module:
        """The module inner steps run: DDP over the ranks, or the model itself (alone, or sharded by FSDP)."""
        if not self.distributed or sharded:
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

    def averager(self, endpoint: Optional[Averager], networked: bool,
                 kept_dtype: torch.dtype = torch.float32) -> Averager:
        """What this rank's trainer averages with: rank 0 passes its endpoint (the swarm) and gets it back; the
        other ranks pass None and get a `Follower`, keeping pseudo-gradients in `kept_dtype` as rank 0 does."""
        return endpoint if self.endpoint else Follower(networked, kept_dtype)

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

    def share_outcome(self, outcome: ExchangeOutcome, out: Sequence[torch.Tensor],
                      rows: Optional[Callable[[Optional[Buffers]], Buffers]] = None) -> ExchangeOutcome:
        """Rank 0's outcome of an exchange on every rank: its summary, then, if it committed, the averaged
        pseudo-gradient broadcast into `out` (a sharded peer: `rows(rank 0's averaged buffers or None)` gives each
        rank's rows of the average, read at the outer step, and the outcome carries them; rank 0 keeps its
        residual). Called in the training thread (never in an exchange's thread: collectives from two threads on
        one process group would interleave)."""
        if not self.distributed:
            return outcome
        if self.endpoint:
            self.share((dataclasses.replace(outcome, averaged=None, residual=None), outcome.averaged is not None))
            if rows is not None and outcome.averaged is not None:
                return dataclasses.replace(outcome, averaged=rows(outcome.averaged))
            for t in outcome.averaged or []:
                self.broadcast(t)
            return outcome
        brief, committed = self.share(None)
        if committed and rows is not None:
            return dataclasses.replace(brief, averaged=rows(None))
        if committed:
            for t in out:
                self.broadcast(t)
        return dataclasses.replace(brief, averaged=out if committed else None)

    def answer(self, ask: Callable[[], Any]) -> Any:
        """Rank 0's `ask()` on every rank (the other ranks do not call it), or the SwarmError it raised, raised on
        every rank."""
        if not self.distributed:
            return ask()
        got, error = None, None
        if self.endpoint:
            try:
                got = ask()
            except SwarmError as e:
                error = str(e)
        got, error = self.share((got, error))
        if error is not None:
            raise SwarmError(error)
        return got

    def share_state(self, tensors: Callable[[], dict[str, torch.Tensor]],
                    destinations: Callable[[list], dict[str, torch.Tensor]], position: Position,
                    sharded: bool = False) -> Optional[Position]:
        """Every rank takes rank 0's state: its tensors (by name, into `destinations(specs)` on the other
        ranks; not on a sharded peer, whose ranks each hold their own rows) and its `position`, which is returned
        on every rank. None on a single-process peer."""
        if not self.distributed:
            return None
        if sharded:
            return self.share(position)
        mine = tensors() if self.endpoint else None
        specs = self.share([TensorSpec.of(n, t) for n, t in mine.items()] if mine is not None else None)
        targets = mine if mine is not None else destinations(specs)
        for spec in specs:
            self.broadcast(targets[spec.name])
        return self.share(position)

    def _group_of(self, tensor: torch.Tensor) -> Any:
        return self._cpu_group if tensor.device.type == "cpu" else dist.group.WORLD


SINGLE = Ranks()


def check(cfg: Config, nproc: int) -> None:
    """UsageError (exit 2) naming the key if `nproc` ranks cannot train `cfg` here."""
    check_batch(cfg, nproc)
    check_rows(cfg, nproc)
    check_devices(cfg, nproc)


def check_batch(cfg: Config, nproc: int) -> None:
    """UsageError naming the key if `nproc` ranks cannot share `cfg`'s batch, on any machine."""
    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {nproc}")
    micro = cfg.inner.micro_batch_size
    if cfg.data.batch_size % (nproc * (micro or 1)):
        by = f"inner.micro_batch_size {micro} x --nproc-per-node {nproc}" if micro else f"--nproc-per-node {nproc}"
        raise UsageError(f"data.batch_size {cfg.data.batch_size} is not divisible by {by}")


def check_rows(cfg: Config, nproc: int) -> None:
    """UsageError naming the tensor if `inner.parallel: fsdp` would leave a rank without a row of the smallest
    tensor it shards (rows of dim 0, swarm/train/sharding.py): before any rank allocates. The model's shapes come
    from `model` (a `model.pretrained` folder's are read when it loads)."""
    m = cfg.model
    if cfg.inner.parallel != "fsdp" or nproc <= 1 or m.pretrained is not None:
        return
    kv_rows = (m.num_kv_heads or m.num_heads) * (m.hidden_size // m.num_heads)
    rows, name = min((m.hidden_size, "model.norm.weight (model.hidden_size)"),
                     (kv_rows, "model.layers.0.self_attn.k_proj.weight (model.num_kv_heads x head size)"),
                     key=lambda item: item[0])
    if nproc > rows:
        raise UsageError(f"--nproc-per-node {nproc} exceeds the {rows} rows of {name}, the smallest tensor "
                         f"inner.parallel fsdp shards by rows: at most {rows} ranks")


def check_devices(cfg: Config, nproc: int) -> None:
    """UsageError naming the count if this machine has fewer devices of `diloco.device`'s kind than ranks."""
    if torch.device(cfg.diloco.device).type == "cuda":
        available = torch.cuda.device_count()
        if nproc > available:
            raise UsageError(f"--nproc-per-node {nproc} exceeds the {available} CUDA devices here "
                             f"(diloco.device {cfg.diloco.device})")


class Follower(Averager):
    """The averager of a rank other than 0: it never talks to the swarm. Its trainer takes rank 0's answers
    through the collectives of `Ranks` (`share_outcome`, `answer`, `share_state`) at the same points."""

    def __init__(self, networked: bool, kept_dtype: torch.dtype = torch.float32):
        self.networked, self.kept_dtype = networked, kept_dtype

    def average(self, outer_step: int, pseudo_grad: PseudoGradient, samples: int,
                out: Sequence[torch.Tensor] | Buffers, base: str = "") -> ExchangeOutcome:
        return ExchangeOutcome(None, note="rank 0 averages")

    def fetch_state(self, intake: Intake, outer_step: int, sha256: str, donors: Optional[list[str]] = None,
                    must: bool = False) -> Optional[Download]:
        raise RuntimeError("only rank 0 fetches a state (Ranks.answer)")
