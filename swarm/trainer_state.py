"""How a trainer's state leaves it and enters it: the snapshot it serves, a downloaded state taken in, its
checkpoint written and resumed, and catching up with the swarm (a `Trainer` mixin, swarm/trainer.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from swarm import state as peer_state
from swarm.averaging import Intake, Snapshot
from swarm.history import history_from_dict, history_to_dict
from swarm.ranks import share_state
from swarm.state import TensorSpec
from swarm.tensors import dtype_of

if TYPE_CHECKING:
    from swarm.averaging import Averager
    from swarm.checkpoint import Checkpointer
    from swarm.config import Config
    from swarm.diloco import DiLoCo
    from swarm.fragments import Fragments
    from swarm.history import PeerHistory
    from swarm.ranks import Ranks

log = logging.getLogger("swarm.trainer")


class TrainerState:
    # set by Trainer.__init__
    cfg: Config
    averager: Averager
    checkpointer: Checkpointer
    diloco: DiLoCo
    fragments: Fragments
    optimizer: torch.optim.Optimizer
    ranks: Ranks
    history: PeerHistory
    step: int
    samples_since_commit: int
    error_feedback: Optional[list[torch.Tensor]]

    def snapshot(self) -> Snapshot:
        """What this peer now holds, to serve; also recorded as where it stands (summary.json)."""
        sha = self.diloco.global_sha256()
        self.history.final_round, self.history.final_global_sha256 = self.diloco.round, sha
        # With fragments a state is taken mid-round too: its taker goes on from the same inner step of the round
        # (swarm/fragments.py); with one fragment a taker starts the round, and cuts it short to meet the others.
        meta = {"round": self.diloco.round, "step": self.step, "inner": self.inner if self.fragments.streaming else 0}
        return Snapshot(self.diloco.outer_steps, sha, meta, peer_state.shared_tensors(self.diloco, self.optimizer),
                        self.diloco.version, lambda: self.diloco.version)

    def serve_state(self) -> None:
        """Offer what this peer now holds to the swarm: after a commit, a resume or a download."""
        self.averager.offer_state(self.snapshot())

    def intake(self) -> Intake:
        def accept(meta: dict[str, Any], outer_steps: int) -> None:
            position = [meta.get("round"), meta.get("step"), meta.get("inner", 0)]  # older peers send no inner
            round, step, inner = position
            if not (all(type(v) is int and v >= 0 for v in position) and round <= outer_steps
                    and inner < self.cfg.diloco.inner_steps):
                raise ValueError(f"state position round={round!r} step={step!r} inner={inner!r} at "
                                 f"{outer_steps} outer steps is not a position of this run")
            self._set_position(round, step, outer_steps, inner)
            self.samples_since_commit = 0
            self.error_feedback = None  # it belonged to the local progress we just dropped
            self.diloco.sync_local()
        return Intake(lambda specs: peer_state.destinations(self.diloco, self.optimizer, specs), accept)

    def _checkpoint_parts(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors the next inner step changes, the rest, meta) of this peer's checkpoint."""
        shared = peer_state.shared_tensors(self.diloco, self.optimizer)
        inner = {k: t for k, t in shared.items() if k.startswith("adam.")}
        rest = {k: t for k, t in shared.items() if k not in inner}
        for i, e in enumerate(self.error_feedback or []):
            rest[f"error_feedback.{i}"] = e
        rest["rng"] = torch.get_rng_state()
        # With diloco.delay or fragments the local model runs ahead of the committed state; a checkpoint holds
        # the committed state only, so a resumed peer restarts its local model from it and counts no samples yet.
        samples = 0 if self.cfg.diloco.delay or self.fragments.streaming else self.samples_since_commit
        meta = {"round": self.diloco.round, "step": self.step, "outer_steps": self.diloco.outer_steps,
                "samples_since_commit": samples, "history": history_to_dict(self.history)}
        return inner, rest, meta

    def save_checkpoint(self) -> None:
        if self.checkpointer is not None:
            inner, rest, meta = self._checkpoint_parts()
            self.checkpointer.save({**inner, **rest}, meta)

    def _settle_checkpoint(self) -> None:
        """Before the global parameters or outer momentum change: the checkpoint being written still reads them."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def resume(self) -> bool:
        """Restore from this peer's checkpoint (if any and enabled); True if restored."""
        if self.checkpointer is None or not self.cfg.checkpoint.resume or not self.checkpointer.exists():
            return False
        extras: dict[str, torch.Tensor] = {}

        def destinations(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
            specs = sorted(specs, key=lambda s: peer_state.canonical(s.name))  # written moments first
            shared = [s for s in specs if not s.name.startswith(("error_feedback.", "rng"))]
            extras.update({s.name: torch.empty(s.shape, dtype=dtype_of(s.dtype)) for s in specs if s not in shared})
            return {**peer_state.destinations(self.diloco, self.optimizer, shared), **extras}

        with self.diloco.changing():
            meta = self.checkpointer.load(destinations)
        self._set_position(meta["round"], meta["step"], meta.get("outer_steps"))  # written before fragments: rounds
        self.samples_since_commit = meta["samples_since_commit"]
        self.diloco.sync_local()
        self.history = history_from_dict(meta["history"])
        torch.set_rng_state(extras["rng"])
        feedback = sorted((k for k in extras if k.startswith("error_feedback.")), key=lambda k: int(k.split(".")[1]))
        self.error_feedback = [extras[k] for k in feedback] or None
        log.info("resumed from %s at round %d (inner step %d)", self.checkpointer.path, self.diloco.round, self.step)
        return True

    def catch_up(self, donors: Optional[list[str]] = None, must: bool = False) -> bool:
        """Take the swarm's state if it is ahead of ours (from `donors` if given; any state with `must`)."""
        before, sha = self.diloco.round, self.diloco.global_sha256()
        self._settle_checkpoint()
        with self.diloco.changing():
            got = self.averager.fetch_state(self.intake(), self.diloco.outer_steps, sha, donors, must)
            self._share_state()
        if got is not None:
            log.info("caught up from round %d to round %d from a peer's state", before, self.diloco.round)
            self.history.events.append({"event": "state_downloaded", "time": time.time(), "from_round": before,
                                        "to_round": self.diloco.round, "donor": got.donor, "bytes": got.bytes,
                                        "seconds": got.seconds})
        self.serve_state()
        return got is not None

    def _share_state(self) -> None:
        """A multi-process peer: every rank takes rank 0's state (resumed, downloaded, or its own)."""
        position = share_state(self.ranks, lambda: peer_state.shared_tensors(self.diloco, self.optimizer),
                               lambda specs: peer_state.destinations(self.diloco, self.optimizer, specs),
                               (self.diloco.round, self.step, self.diloco.outer_steps, self.inner))
        if position is not None and not self.ranks.endpoint:
            self._set_position(*position)
            self.diloco.sync_local()
