"""The DiLoCo two-level loop for one peer, top to bottom: rounds, then H inner steps, then the outer step.

The inner loop is plain PyTorch (AdamW, warmup + cosine, grad clipping). The only contact with other
peers is `averager.average(...)` at the round boundary; the loop never sees the DHT. Every round
either commits (outer step applied, hash logged, checkpoint written, state offered to newcomers) or is
discarded (the local model keeps its inner progress and the next pseudo-gradient covers both rounds).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from swarm.averaging import Averager, RoundOutcome
from swarm.checkpoint import Checkpointer, CorruptCheckpoint
from swarm.config import Config, InnerConfig
from swarm.data import TrainBatches, load_corpus
from swarm.diloco import DiLoCo
from swarm.model import build_model, count_parameters

log = logging.getLogger("swarm.trainer")


@dataclass
class RoundRecord:
    """What one committed (or discarded) round leaves in the log and in summary.json."""

    round: int  # the outer step this record closes (1-based after commit)
    committed: bool
    train_loss: float
    eval_loss: Optional[float]
    global_sha256: str
    group_size: int
    samples: int
    compute_s: float
    comm_s: float
    bytes_sent: int
    bytes_received: int
    tokens_per_s: float
    note: str = ""
    time: float = 0.0  # unix time when the round closed


@dataclass
class PeerHistory:
    peer_id: str
    initial_eval_loss: Optional[float] = None
    rounds: list[RoundRecord] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


def lr_lambda(cfg: InnerConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine to `min_lr_ratio` at `total_steps`."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], device: str) -> float:
    model.eval()
    losses = [model(input_ids=b.to(device), labels=b.to(device)).loss.item() for b in batches]
    model.train()
    return sum(losses) / len(losses)


class Trainer:
    """One peer's model, inner optimizer, DiLoCo state and data, with save/restore of all of it."""

    def __init__(self, cfg: Config, averager: Averager, peer_id: str, shard: int, out_dir: Path,
                 on_round: Optional[Callable[[RoundRecord], None]] = None):
        self.cfg, self.averager, self.on_round, self.out_dir = cfg, averager, on_round, out_dir
        self.device = cfg.diloco.device
        corpus = load_corpus(cfg.data)
        self.batches = TrainBatches(corpus, cfg.data, shard)
        self.eval_batches = corpus.eval_batches(cfg.data)
        self.model = build_model(cfg.model, corpus.tokenizer.vocab_size).to(self.device)
        self.diloco = DiLoCo(self.model, cfg.outer, cfg.diloco.global_device)
        inner = cfg.inner
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2),
                                           eps=inner.eps, weight_decay=inner.weight_decay)
        total = cfg.diloco.rounds * cfg.diloco.inner_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(inner, total))
        self.step = 0  # inner steps done by this peer: the schedule position and the data position
        self.samples_since_commit = 0
        # swarm.error_feedback: what quantization dropped from this peer's last committed contribution, added
        # to its next pseudo-gradient. Per peer: in its checkpoint, never in the state served to newcomers.
        self.error_feedback: Optional[list[torch.Tensor]] = None
        self.history = PeerHistory(peer_id=peer_id)
        ckpt_dir = cfg.checkpoint.dir or out_dir / "checkpoint"
        self.checkpointer = Checkpointer(ckpt_dir) if cfg.checkpoint.every > 0 else None
        log.info("peer %s: %d parameters, shard %d, %d rounds x %d inner steps",
                 peer_id, count_parameters(self.model), shard, cfg.diloco.rounds, cfg.diloco.inner_steps)

    # ---- state: the same dict goes to checkpoints and to newcomers -------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "diloco": self.diloco.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "samples_since_commit": self.samples_since_commit,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.diloco.load_state_dict(state["diloco"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.samples_since_commit = int(state["samples_since_commit"])

    def validate_state(self, state: dict[str, Any]) -> None:
        self.diloco.validate_state(state["diloco"])

    def save_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        state = self.state_dict()
        state["history"] = _history_to_dict(self.history)
        state["rng"] = torch.get_rng_state()
        state["error_feedback"] = self.error_feedback
        self.checkpointer.save(state)

    def resume(self) -> bool:
        """Restore from this peer's checkpoint (if any and enabled); True if restored."""
        if self.checkpointer is None or not self.cfg.checkpoint.resume or not self.checkpointer.exists():
            return False
        state = self.checkpointer.load()
        self.validate_state(state)
        self.load_state_dict(state)
        self.history = _history_from_dict(state["history"])
        torch.set_rng_state(state["rng"])
        self.error_feedback = state.get("error_feedback")
        log.info("resumed from %s at round %d (inner step %d)", self.checkpointer.path, self.diloco.round, self.step)
        return True

    def catch_up(self, donors: Optional[list[str]] = None) -> bool:
        """If the swarm is past our round, take the state from a peer; True if we did.

        With `donors` (peers on other global parameters than ours, at our round or past it) take theirs.
        """
        newer_than = self.diloco.round - 1 if donors else self.diloco.round
        state = self.averager.fetch_state(newer_than, self.validate_state, donors)
        if state is None:
            return False
        before = self.diloco.round
        self.load_state_dict(state)
        self.samples_since_commit = 0
        self.error_feedback = None  # it belonged to the local progress we just dropped
        log.info("caught up from round %d to round %d from a peer's state", before, self.diloco.round)
        self.history.events.append({"event": "state_downloaded", "time": time.time(), "from_round": before,
                                    "to_round": self.diloco.round})
        self.averager.offer_state(self.diloco.round, self.state_dict())
        return True

    # ---- the loop ------------------------------------------------------------------------------------
    def inner_step(self) -> float:
        batch = self.batches.batch(self.step).to(self.device)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.samples_since_commit += batch.shape[0]
        return loss.item()

    def train(self, progress: Optional[Callable[[int, int, float], None]] = None) -> PeerHistory:
        cfg = self.cfg.diloco
        try:
            self.resume()
        except CorruptCheckpoint as e:
            if not self.averager.networked:
                raise
            log.warning("%s; falling back to the state of peers", e)
            self.history.events.append({"event": "corrupt_checkpoint", "time": time.time(), "error": str(e)})
        if not self.catch_up():
            self.averager.offer_state(self.diloco.round, self.state_dict())
        if self.history.initial_eval_loss is None:
            self.history.initial_eval_loss = evaluate(self.model, self.eval_batches, self.device)
            log.info("round %d: eval loss %.4f (before training)", self.diloco.round, self.history.initial_eval_loss)
        tokens_per_step = self.cfg.data.batch_size * self.cfg.data.seq_len

        while self.diloco.round < cfg.rounds:
            # H inner steps: plain PyTorch on this peer's shard. A straggler stops early once a faster peer
            # waits to average, and contributes the steps it has (the average is weighted by samples).
            start, losses, last_report = time.perf_counter(), [], 0.0
            for i in range(cfg.inner_steps):
                self._inject_faults(i)
                losses.append(self.inner_step())
                if progress is not None:
                    progress(self.diloco.round, i + 1, losses[-1])
                if time.perf_counter() - last_report >= self.cfg.swarm.progress_interval:
                    last_report = time.perf_counter()
                    self._publish_progress(start, len(losses))
                    if i + 1 < cfg.inner_steps and self.averager.others_ready(self.diloco.round):
                        log.info("round %d: peers wait to average; contributing %d of %d inner steps",
                                 self.diloco.round + 1, i + 1, cfg.inner_steps)
                        self._inject_faults(i + 1, stopping_early=True)
                        break
            compute_s = time.perf_counter() - start
            self._publish_progress(start, len(losses), ready=True)

            # The outer step: average the pseudo-gradients, then commit or discard the round.
            pseudo_grad, samples = self.diloco.pseudo_gradient(), self.samples_since_commit
            if self.error_feedback is not None:
                pseudo_grad = [g + e.to(g.device) for g, e in zip(pseudo_grad, self.error_feedback)]
            before = [g.clone() for g in self.diloco.global_params] if self.cfg.logging.dump_tensors else None
            outcome = self.averager.average(self.diloco.round, pseudo_grad, samples, self.diloco.global_sha256())
            record = self._close_round(outcome, sum(losses) / len(losses), compute_s,
                                       tokens_per_step * len(losses) / compute_s)
            if self.cfg.logging.dump_tensors:
                self._dump(record, pseudo_grad, samples, before)
            if self.on_round is not None:
                self.on_round(record)
        return self.history

    def _publish_progress(self, start: float, steps: int, ready: bool = False) -> None:
        samples_per_s = steps * self.cfg.data.batch_size / max(1e-9, time.perf_counter() - start)
        self.averager.publish_progress(self.diloco.round, self.step, self.samples_since_commit, samples_per_s, ready)

    def _inject_faults(self, inner_step: int, stopping_early: bool = False) -> None:
        """`faults` config: sleep like a slow peer, or SIGKILL this process halfway through a round (or where
        it cuts that round short, if that comes first)."""
        faults = self.cfg.faults
        if faults.step_delay > 0 and not stopping_early:
            time.sleep(faults.step_delay)
        if (faults.kill_phase == "inner" and faults.kill_round == self.diloco.round + 1
                and (inner_step == self.cfg.diloco.inner_steps // 2 or stopping_early)):
            log.warning("fault injection: killing this peer (SIGKILL) in round %d", self.diloco.round + 1)
            os.kill(os.getpid(), signal.SIGKILL)

    def _close_round(self, outcome: RoundOutcome, train_loss: float, compute_s: float,
                     tokens_per_s: float) -> RoundRecord:
        committed = outcome.averaged is not None
        if committed:
            self.diloco.outer_step(outcome.averaged)
            self.samples_since_commit = 0
            self.error_feedback = outcome.residual if self.cfg.swarm.error_feedback else None
        elif outcome.behind:
            log.warning("round %d: %s", self.diloco.round + 1, outcome.note)
            self.catch_up(outcome.donors or None)
        else:
            log.warning("round %d discarded (%s): keeping local progress for the next attempt",
                        self.diloco.round + 1, outcome.note)
        eval_loss = None
        if committed and self.diloco.round % self.cfg.diloco.eval_every == 0:
            eval_loss = evaluate(self.model, self.eval_batches, self.device)
        record = RoundRecord(
            round=self.diloco.round, committed=committed, train_loss=train_loss, eval_loss=eval_loss,
            global_sha256=self.diloco.global_sha256(), group_size=outcome.group_size,
            samples=outcome.total_samples, compute_s=compute_s, comm_s=outcome.comm_s,
            bytes_sent=outcome.bytes_sent, bytes_received=outcome.bytes_received,
            tokens_per_s=tokens_per_s, note=outcome.note, time=time.time(),
        )
        self.history.rounds.append(record)
        if committed:
            log.info("round %d committed: train loss %.4f, eval loss %s, group %d, %.0f tokens/s, compute %.1fs, "
                     "comm %.2fs, global %s", record.round, train_loss,
                     "-" if eval_loss is None else f"{eval_loss:.4f}", outcome.group_size, tokens_per_s, compute_s,
                     outcome.comm_s, record.global_sha256[:12])
            if self.checkpointer is not None and self.diloco.round % self.cfg.checkpoint.every == 0:
                self.save_checkpoint()
            self.averager.offer_state(self.diloco.round, self.state_dict())
        return record

    def _dump(self, record: RoundRecord, pseudo_grad: list[torch.Tensor], samples: int,
              global_before: list[torch.Tensor]) -> None:
        """Evidence for tests: what this peer contributed and what it committed, per attempt."""
        folder = self.out_dir / "tensors"
        folder.mkdir(parents=True, exist_ok=True)
        attempt = len(self.history.rounds)
        torch.save({"record": record.__dict__, "pseudo_grad": pseudo_grad, "samples": samples,
                    "global_before": global_before, "global_after": self.diloco.state_dict()["global_params"]},
                   folder / f"attempt-{attempt:04d}.pt")


def _history_to_dict(history: PeerHistory) -> dict[str, Any]:
    return {"peer_id": history.peer_id, "initial_eval_loss": history.initial_eval_loss,
            "rounds": [r.__dict__ for r in history.rounds], "events": history.events}


def _history_from_dict(d: dict[str, Any]) -> PeerHistory:
    return PeerHistory(d["peer_id"], d["initial_eval_loss"], [RoundRecord(**r) for r in d["rounds"]], d["events"])
