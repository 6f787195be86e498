"""How a trainer's state leaves it and enters it: the snapshot it serves, a downloaded state taken in, its
checkpoint written and resumed, and catching up with the swarm.

The trainer (swarm/train/trainer.py) owns the pieces: `Parts`, what its state lives in (the model, DiLoCo's
global parameters and momentum, the inner optimizer, ...), and `Progress`, how far its own training went beyond
the counters DiLoCo keeps. A `StateKeeper` is given both, and a way to move the trainer to a position; it reads
and writes nothing else of the trainer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from swarm.errors import SwarmError
from swarm.state import peerstate as peer_state
from swarm.state import shard_state
from swarm.state.checkpoint import Checkpointer, CorruptCheckpoint
from swarm.state.peerstate import Position, StateNames, TensorSpec
from swarm.state.statehash import covers
from swarm.tensors import dtype_of
from swarm.train.averaging import Intake, Snapshot
from swarm.train.history import PeerHistory, history_from_dict, history_to_dict

if TYPE_CHECKING:
    from swarm.config import Config
    from swarm.data.batches import Corpus
    from swarm.data.peerdata import PeerData
    from swarm.train.averaging import Averager
    from swarm.train.diloco import DiLoCo
    from swarm.train.fragments import Fragments
    from swarm.train.ranks import Ranks

log = logging.getLogger("swarm.trainer")
FINISH_TRIES = 3  # states taken at the end of a run before it gives up on settling on one hash


@dataclass(frozen=True)
class Parts:
    """What a peer's state lives in and travels through, built once by the trainer."""

    cfg: Config
    model: torch.nn.Module
    diloco: DiLoCo  # the global parameters, outer momentum, rounds closed and outer steps
    fragments: Fragments
    optimizer: torch.optim.Optimizer  # the inner AdamW
    ranks: Ranks
    averager: Averager
    corpus: Corpus
    data: PeerData
    out_dir: Path


@dataclass
class Progress:
    """How far this peer's own training went, beyond the counters DiLoCo keeps: what the loop moves, a checkpoint
    records, a resume restores and a taken state resets."""

    history: PeerHistory
    samples: list[int]  # per fragment: the samples its next pseudo-gradient covers
    step: int = 0  # inner steps done by this peer: the schedule position and the data position
    inner: int = 0  # inner steps done in the current round
    # swarm.error_feedback: what quantization dropped from this peer's last committed contribution, added to its
    # next pseudo-gradient. Per peer: in its checkpoint, never in the state served to newcomers.
    error_feedback: Optional[list[torch.Tensor]] = None


class StateKeeper:
    """A trainer's state in and out (see the module's docstring). `set_position` moves the trainer to a position
    (its learning-rate schedule follows); the keeper calls it when a state is taken or resumed."""

    def __init__(self, parts: Parts, progress: Progress, set_position: Callable[[Position], None]):
        self.progress, self._set_position = progress, set_position
        self.cfg, self.model, self.diloco, self.fragments, self.optimizer = (
            parts.cfg, parts.model, parts.diloco, parts.fragments, parts.optimizer)
        self.ranks, self.averager, self.corpus, self.data, self.out_dir = (
            parts.ranks, parts.averager, parts.corpus, parts.data, parts.out_dir)
        self._taken: Optional[shard_state.Whole] = None  # a sharded peer: the state rank 0 took, until shared
        self.checkpointer = self._make_checkpointer()

    @property
    def position(self) -> Position:
        return Position(self.diloco.round, self.progress.step, self.diloco.outer_steps, self.progress.inner)

    @cached_property
    def served(self) -> shard_state.Served:
        """A sharded peer: rank 0's copy of what it serves (swarm/state/shard_state.py), in <out>/shards."""
        return shard_state.Served(self.out_dir / "shards")

    @cached_property
    def names(self) -> StateNames:
        """The state_dict names checkpoints store this peer's tensors by."""
        return StateNames.of(self.model)

    @cached_property
    def run_meta(self) -> dict[str, Any]:
        """What every checkpoint records of the run: its fingerprint, config and the model's Hugging Face config
        (`swarm export` builds the model from it, without the `model.pretrained` folder)."""
        from swarm.run.runid import run_identity

        fingerprint = run_identity(self.cfg, self.corpus.prepared.meta["sha256"]).fingerprint
        return {"fingerprint": fingerprint, "config": self.cfg.to_dict(),
                "hf_config": json.loads(self.model.config.to_json_string(use_diff=False))}

    def snapshot(self) -> Snapshot:
        """What this peer now holds, to serve: the global parameters and outer momentum under the state's hash
        (swarm/state/statehash.py), never its AdamW moments; also recorded as where it stands (summary.json)."""
        sha = self.diloco.global_sha256()
        history = self.progress.history
        history.final_round, history.final_global_sha256 = self.diloco.round, sha
        # With fragments a state is taken mid-round too: its taker goes on from the same inner step of the round
        # (swarm/train/fragments.py); with one fragment a taker starts the round, and cuts it short to meet the others.
        # `step` is for the record only: a taker does not take it (intake).
        progress = self.progress
        meta = {"round": self.diloco.round, "step": progress.step,
                "inner": progress.inner if self.fragments.streaming else 0}
        if self.diloco.shards is not None:  # every rank: gathered into rank 0's copy (swarm/state/shard_state.py)
            served = self.served
            return Snapshot(self.diloco.outer_steps, sha, meta, served.refresh(self.diloco, self.diloco.shards) or {},
                            served.version, lambda: served.version)
        return Snapshot(self.diloco.outer_steps, sha, meta, peer_state.served_tensors(self.diloco),
                        self.diloco.version, lambda: self.diloco.version)

    def serve_state(self) -> None:
        """Offer what this peer now holds to the swarm: after a commit, a resume or a download."""
        self.averager.offer_state(self.snapshot())

    def intake(self) -> Intake:
        """How a downloaded state is taken in: only what the state's hash covers (swarm/state/statehash.py), so that a
        donor can hand us nothing the swarm's commit records do not vouch for. A state carrying any other tensor
        (AdamW moments) is refused, naming it; our inner optimizer starts afresh. The position: the rounds
        closed (hashed), the inner step of the round (bounded: below H, and 0 with one fragment), and from them
        the schedule's inner step `rounds * H + inner`, whatever step the donor says it is at (its own)."""
        steps = self.cfg.diloco.inner_steps

        def accept(meta: dict[str, Any], outer_steps: int) -> None:
            round, inner = meta.get("round"), meta.get("inner", 0)  # older peers send no inner
            if not (all(type(v) is int and v >= 0 for v in (round, inner)) and round <= outer_steps
                    and inner < steps and (inner == 0 or self.fragments.streaming)):
                raise ValueError(f"state position round={round!r} inner={inner!r} at {outer_steps} outer steps "
                                 f"is not a position of this run")
            self._set_position(Position(round, round * steps + inner, outer_steps, inner))
            self.progress.error_feedback = None  # it belonged to the local progress we just dropped
            self.diloco.sync_local()
            self._taken = incoming[0] if incoming else None  # a sharded peer's ranks take their rows of it next

        incoming: list[shard_state.Whole] = []

        def destinations(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
            foreign = [s.name for s in specs if not covers(s.name)]
            if foreign:
                raise ValueError(f"the state carries {foreign[0]}, which the state's hash does not cover: one "
                                 f"takes only global parameters and outer momentum (a donor's AdamW moments are its)")
            if self.diloco.shards is None:
                return peer_state.destinations(self.diloco, self.optimizer, specs)
            incoming[:] = [shard_state.incoming(self.diloco, self.out_dir / "shards", specs)]
            return incoming[0].tensors
        return Intake(destinations, accept)

    def checkpoint_parts(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors the next inner step changes, the rest, meta) of this peer's checkpoint, by state_dict name."""
        if self.diloco.shards is None:
            shared = peer_state.shared_tensors(self.diloco, self.optimizer)
        else:  # this rank's rows (swarm/state/shard_checkpoint.py); what every rank holds whole, rank 0 writes
            shared = shard_state.local_tensors(self.diloco, self.optimizer)
            if not self.ranks.endpoint:
                shared = {k: t for k, t in shared.items() if shard_state.placement(self.diloco, k) is not None}
        if self.ranks.endpoint:
            for i, e in enumerate(self.progress.error_feedback or []):
                shared[f"error_feedback.{i}"] = e
            shared["rng"] = torch.get_rng_state()
        named = {self.names.named(k): t for k, t in shared.items()}
        inner = {k: t for k, t in named.items() if k.startswith("adam.")}
        rest = {k: t for k, t in named.items() if k not in inner}
        # With diloco.delay or fragments the local model runs ahead of the committed state; a checkpoint holds
        # the committed state only, so a resumed peer restarts its local model from it and counts no samples yet.
        samples = 0 if self.cfg.diloco.delay or self.fragments.streaming else self.progress.samples[-1]
        meta = {"round": self.diloco.round, "step": self.progress.step, "outer_steps": self.diloco.outer_steps,
                "samples_since_commit": samples, "history": history_to_dict(self.progress.history), **self.run_meta,
                "data": self.data.state()}
        return inner, rest, meta

    def _make_checkpointer(self) -> Optional[Checkpointer]:
        """This peer's checkpoints (`checkpoint.dir`, default <out>/checkpoint; a peer's rank 0 writes them, each
        rank of a sharded peer its part), None with `checkpoint.every: 0`."""
        if self.cfg.checkpoint.every <= 0:
            return None
        if self.diloco.shards is not None:  # every rank writes its rows
            from swarm.state.shard_checkpoint import ShardCheckpointer

            return ShardCheckpointer(self.cfg.checkpoint.dir or self.out_dir / "checkpoint", self.cfg.checkpoint.keep,
                                     self.ranks.rank, self.ranks.world_size, self.ranks.share(os.getpid()),
                                     lambda name: shard_state.placement(self.diloco, self.names.positional(name)))
        if not self.ranks.endpoint:
            return None
        return Checkpointer(self.cfg.checkpoint.dir or self.out_dir / "checkpoint", self.cfg.checkpoint.keep)

    def save_checkpoint(self) -> None:
        if self.checkpointer is not None:
            inner, rest, meta = self.checkpoint_parts()
            self.checkpointer.save({**inner, **rest}, meta)

    def settle_checkpoint(self) -> None:
        """Before the global parameters or outer momentum change: the checkpoint being written still reads them."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def resume(self) -> bool:
        """Restore from this peer's checkpoint (if any and enabled); True if restored."""
        if self.checkpointer is None or not self.cfg.checkpoint.resume or not self.checkpointer.exists():
            return False
        extras: dict[str, torch.Tensor] = {}

        def destinations(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
            specs = [TensorSpec(self.names.positional(s.name), s.dtype, s.shape) for s in specs]
            specs = sorted(specs, key=lambda s: peer_state.canonical(s.name))  # in the order of a served state
            shared = [s for s in specs if not s.name.startswith(("error_feedback.", "rng"))]
            extras.update({s.name: torch.empty(s.shape, dtype=dtype_of(s.dtype)) for s in specs if s not in shared
                           and (self.ranks.endpoint or s.name == "rng")})
            if self.diloco.shards is None:
                targets = {**peer_state.destinations(self.diloco, self.optimizer, shared), **extras}
            else:  # this rank's rows of each, at their offset in the whole tensor, from whichever pieces hold them
                shard_state.check(self.diloco, shared)
                local = shard_state.prepare(self.diloco, self.optimizer, {s.name for s in shared})
                where = {k: shard_state.placement(self.diloco, k) for k in local}
                targets = {**{k: t if where[k] is None else (t, where[k][0]) for k, t in local.items()}, **extras}
            return {self.names.named(k): t for k, t in targets.items()}

        with self.diloco.changing():
            meta = self._load_checkpoint(destinations)
        self._set_position(Position.at_round(meta["round"], meta["step"], meta.get("outer_steps")))
        self.data.restore(meta.get("data", {}), meta["step"])  # its shard and position: taken up in _join
        self.progress.samples[-1] = meta["samples_since_commit"]
        self.diloco.sync_local()
        self.progress.history = history_from_dict(meta["history"])
        torch.set_rng_state(extras["rng"])
        feedback = sorted((k for k in extras if k.startswith("error_feedback.")), key=lambda k: int(k.split(".")[1]))
        self.progress.error_feedback = [extras[k] for k in feedback] or None
        log.info("resumed from %s at round %d (inner step %d)", self.checkpointer.last_read, self.diloco.round,
                 self.progress.step)
        return True

    def _load_checkpoint(self, destinations) -> dict[str, Any]:
        """`checkpointer.load`; a sharded peer's ranks each load their rows and agree: all failed (a damaged index,
        say) is a CorruptCheckpoint on every rank, some failed a SwarmError (their parts cannot be mixed)."""
        if self.diloco.shards is None:
            return self.checkpointer.load(destinations)
        error: Optional[CorruptCheckpoint] = None
        try:
            meta = self.checkpointer.load(destinations)
        except CorruptCheckpoint as e:
            error = e
        shards = self.diloco.shards
        if shards.all_true(error is None):
            return meta
        if shards.all_true(error is not None):
            raise error
        raise SwarmError(f"rank {self.ranks.rank}: {error or 'another rank could not read its part'}: the ranks of "
                         f"this peer cannot resume together (start over: --fresh)")

    def catch_up(self, donors: Optional[list[str]] = None, must: bool = False) -> bool:
        """Take the swarm's state if it is ahead of ours (from `donors` if given; any state with `must`)."""
        before, sha = self.diloco.round, self.diloco.global_sha256()
        self.settle_checkpoint()
        with self.diloco.changing():
            got = self.ranks.answer(lambda: self.averager.fetch_state(self.intake(), self.diloco.outer_steps, sha,
                                                                      donors, must))
            self.share_state()
        if got is not None:
            log.info("took the state of round %d from %s (%.0f MB in %.1f s; this peer was at round %d)",
                     self.diloco.round, got.donor, got.bytes / 1e6, got.seconds, before)
            self.progress.history.events.append({
                "event": "state_downloaded", "time": time.time(), "from_round": before, "to_round": self.diloco.round,
                "donor": got.donor, "bytes": got.bytes, "seconds": got.seconds})
        self.serve_state()
        return got is not None

    def finish(self) -> None:
        """The end of a run agrees: serve the state to peers that still need it (`Averager.finish`), and where the
        swarm committed another hash at our last outer step (a last round that ended split between two groups),
        take the swarm's state, checkpoint it and serve that, at most FINISH_TRIES times."""
        for _ in range(FINISH_TRIES):
            sha, outer_steps = self.diloco.global_sha256(), self.diloco.outer_steps
            donors = self.ranks.answer(lambda s=outer_steps, h=sha: self.averager.finish(s, h))
            if donors is None:
                return
            if self.catch_up(donors):
                self.save_checkpoint()
                self.progress.history.events.append({"event": "end_agreed", "time": time.time(), "from_sha256": sha,
                                                     "to_sha256": self.diloco.global_sha256()})
        raise SwarmError(f"the end of the run did not settle on one hash after {FINISH_TRIES} states taken "
                         f"(last held: {self.diloco.global_sha256()[:12]})")

    def share_state(self) -> None:
        """A multi-process peer: every rank takes rank 0's state (resumed, downloaded, or its own). A sharded peer's
        ranks take their rows of a state rank 0 downloaded (swarm/state/shard_state.py), and its position."""
        shards = self.diloco.shards
        if shards is not None:
            names = self.ranks.share([s.name for s in self._taken.specs] if self._taken is not None else None)
            if names:
                shard_state.spread(self.diloco, self.optimizer, shards, names, self._taken)
                self.diloco.sync_local()
            self._taken = None
        position = self.ranks.share_state(lambda: peer_state.shared_tensors(self.diloco, self.optimizer),
                                          lambda specs: peer_state.destinations(self.diloco, self.optimizer, specs),
                                          self.position, sharded=self.diloco.shards is not None)
        if position is not None and not self.ranks.endpoint:
            self._set_position(position)
            self.diloco.sync_local()
