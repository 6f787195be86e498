"""The DiLoCo two-level loop for one peer, top to bottom: rounds, then H inner steps, then the outer step.

The inner loop is plain PyTorch (AdamW, warmup + cosine, grad clipping). The only contact with other
peers is `averager.average(...)` at the round boundary; the loop never sees the DHT. Every round
either commits (outer step applied, hash logged, checkpoint written, state offered to newcomers) or is
discarded (the local model keeps its inner progress and the next pseudo-gradient covers both rounds).
A peer whose local model went NaN/Inf, or that learns the swarm has committed a later round, takes the
swarm's state; if no peer can give it, it stops (SwarmError) rather than train on from a stale state.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from swarm import state as peer_state
from swarm.averaging import Averager, PeerStats, RoundOutcome
from swarm.checkpoint import Checkpointer, CorruptCheckpoint
from swarm.config import Config
from swarm.data import TrainBatches, load_corpus
from swarm.diloco import DiLoCo
from swarm.errors import SwarmError
from swarm.fragments import Fragments, TrainerHooks
from swarm.history import PeerHistory, RoundRecord, dump_round, round_inputs
from swarm.inner import autocast, build_optimizer, evaluate, forward_backward, lr_lambda
from swarm.model import build_model, count_parameters
from swarm.overlap import Exchange
from swarm.ranks import SINGLE, Ranks
from swarm.trainer_state import TrainerState

log = logging.getLogger("swarm.trainer")


class Trainer(TrainerState):
    """One peer's model, inner optimizer, DiLoCo state and data, with save/restore of all of it."""

    def __init__(self, cfg: Config, averager: Averager, peer_id: str, shard: int, out_dir: Path,
                 on_round: Optional[Callable[[RoundRecord], None]] = None, ranks: Ranks = SINGLE):
        self.cfg, self.averager, self.on_round, self.out_dir, self.ranks = cfg, averager, on_round, out_dir, ranks
        self.device = cfg.diloco.device
        corpus = load_corpus(cfg.data)
        self.batches = TrainBatches(corpus, cfg.data, shard)
        self.eval_batches = corpus.eval_batches(cfg.data)
        self.model = build_model(cfg.model, corpus.tokenizer.vocab_size).to(self.device)
        self.diloco = DiLoCo(self.model, cfg.outer, cfg.diloco.global_device, cfg.diloco.mix_alpha)
        # diloco.fragments: the round's own exchange is the last fragment's (all tensors with 1 fragment)
        self.fragments = Fragments(self.diloco, cfg.diloco, averager, TrainerHooks(
            self._settle_checkpoint, lambda event: self.history.events.append(event), self.catch_up, self.serve_state))
        self.precision = autocast(cfg.inner.precision, self.device)
        self.optimizer = build_optimizer(self.model, cfg)
        self.train_model = ranks.wrap(self.model)  # DDP over the peer's ranks, or the model itself
        total = cfg.diloco.rounds * cfg.diloco.inner_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg.inner, total))
        self.step = 0  # inner steps done by this peer: the schedule position and the data position
        self.inner = 0  # inner steps done in the current round
        self.samples_since_commit = 0
        # swarm.error_feedback: what quantization dropped from this peer's last committed contribution, added
        # to its next pseudo-gradient. Per peer: in its checkpoint, never in the state served to newcomers.
        self.error_feedback: Optional[list[torch.Tensor]] = None
        self.history = PeerHistory(peer_id=peer_id)
        self.last_eval: Optional[tuple[int, float]] = None  # (round, held-out loss), shown to watchers
        ckpt_dir = cfg.checkpoint.dir or out_dir / "checkpoint"
        self.checkpointer = Checkpointer(ckpt_dir) if cfg.checkpoint.every > 0 and ranks.endpoint else None
        log.info("peer %s: %d parameters, shard %d, %d rounds x %d inner steps",
                 peer_id, count_parameters(self.model), shard, cfg.diloco.rounds, cfg.diloco.inner_steps)

    # ---- state: the named tensors of swarm/state.py, in checkpoints and for newcomers ------------------
    def _set_position(self, round: int, step: int, outer_steps: Optional[int] = None, inner: int = 0) -> None:
        """Round, inner step, outer steps committed (default: one per round) and inner steps done in the round;
        the learning-rate schedule follows the step. The local model restarts."""
        self.diloco.round, self.step, self.inner = round, step, inner
        self.diloco.outer_steps = round if outer_steps is None else outer_steps
        self.fragments.restart()
        self.scheduler.last_epoch, self.scheduler._step_count = step, step + 1
        lrs = [base * fn(step) for base, fn in zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler._last_lr = lrs
        peer_state.set_optimizer_step(self.optimizer, step)

    # ---- the loop ------------------------------------------------------------------------------------
    def inner_step(self) -> float:
        batch = self.batches.batch(self.step)
        mine = self.ranks.slice(batch).to(self.device)
        loss = forward_backward(self.train_model, mine, self.cfg.inner.micro_batch_size or len(mine), self.precision)
        loss = self.ranks.mean(loss)
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.inner += 1
        self.samples_since_commit += batch.shape[0]
        return loss.item()

    def train(self, progress: Optional[Callable[[int, int, float], None]] = None) -> PeerHistory:
        cfg = self.cfg.diloco
        self._hold(0)
        try:
            self.resume()
        except CorruptCheckpoint as e:
            if not self.averager.networked:
                raise
            log.warning("%s; falling back to the state of peers", e)
            self.history.events.append({"event": "corrupt_checkpoint", "time": time.time(), "error": str(e)})
        self.catch_up()
        if self.history.initial_eval_loss is None:
            self.history.initial_eval_loss = evaluate(self.model, self.eval_batches, self.device, self.precision)
            self.last_eval = (self.diloco.round, self.history.initial_eval_loss)
            log.info("round %d: eval loss %.4f (before training)", self.diloco.round, self.history.initial_eval_loss)
        tokens_per_step = self.cfg.data.batch_size * self.cfg.data.seq_len

        # diloco.delay: the last round's exchange, averaging behind this round's first inner steps (swarm/overlap.py)
        exchange: Optional[Exchange] = None
        try:
            while True:
                if exchange is not None and self.diloco.round + 1 == cfg.rounds:
                    self._settle(exchange)  # the last round's exchange: no inner steps left to hide it behind
                    exchange = None
                if self.diloco.round >= cfg.rounds:
                    break
                training = self.diloco.round + 1 + (exchange is not None)  # the last round may still be landing
                self._hold(training)
                # H inner steps: plain PyTorch on this peer's shard. A straggler stops early once a faster peer
                # waits to average, and contributes the steps it has (the average is weighted by samples).
                start, losses, last_report = time.perf_counter(), [], 0.0
                if self.checkpointer is not None:
                    self.checkpointer.wait_begun()  # it may still write the last round's AdamW moments: overhead
                inner_start, paused = time.perf_counter(), 0.0  # paused: closing the last round meanwhile
                while self.inner < cfg.inner_steps and self.diloco.round < cfg.rounds:
                    self._inject_faults(training, self.inner)
                    losses.append(self.inner_step())
                    if progress is not None:
                        progress(self.diloco.round, self.inner, losses[-1])
                    if time.perf_counter() - last_report >= self.cfg.swarm.progress_interval:
                        last_report = time.perf_counter()
                        self._publish_progress(inner_start, losses, ready=exchange is not None)
                    if exchange is not None and self.inner == cfg.delay:  # the last round's outer step lands here
                        paused += self._settle(exchange)
                        exchange = None
                    # diloco.fragments: a mid-round exchange that finds us behind moves self.inner (the swarm's state)
                    paused += self.fragments.after_inner_step(self.inner, self.cfg.data.batch_size)
                    if self.inner < cfg.inner_steps and exchange is None and self.fragments.may_stop_early(self.inner) \
                            and self.averager.others_ready(self.diloco.outer_steps):
                        log.info("round %d: peers wait to average; contributing %d of %d inner steps",
                                 self.diloco.round + 1, self.inner, cfg.inner_steps)
                        self._inject_faults(training, self.inner, stopping_early=True)
                        break
                compute_s = time.perf_counter() - inner_start - paused
                if exchange is not None:  # a round cut short before `delay` inner steps
                    self._settle(exchange)
                    exchange = None
                if self.diloco.round >= cfg.rounds:  # a state taken meanwhile ended the run
                    break
                self.inner = 0  # the next round's, unless a state taken at the round's close says otherwise
                boundary = self.fragments.boundary
                pseudo_grad = boundary.pseudo_gradient(self.error_feedback)
                if not (all(map(math.isfinite, losses)) and self.diloco.pseudo_gradient().is_finite()):
                    self._recover_from_non_finite(losses)
                    continue

                # The outer step: average the pseudo-gradients, then commit or discard the round.
                self._publish_progress(inner_start, losses, ready=True)
                samples = self.samples_since_commit
                dumping = self.cfg.logging.dump_tensors and self.ranks.endpoint
                facts = dict(train_loss=sum(losses) / len(losses), compute_s=compute_s, start=start,
                             tokens_per_s=tokens_per_step * len(losses) / compute_s)
                if cfg.delay:
                    exchange = Exchange(boundary, self.averager, samples, self.error_feedback, **facts)
                    exchange.dump = round_inputs(exchange.pseudo_grad, samples, self.diloco) if dumping else None
                    continue
                dump = round_inputs(pseudo_grad, samples, self.diloco) if dumping else None
                checkpoint = self._checkpoint_due()
                if checkpoint:  # the AdamW moments go to disk while the round averages
                    self.checkpointer.begin(self._checkpoint_parts()[0])
                outcome = self.averager.average(boundary.round, pseudo_grad, samples, boundary.outer_grads(),
                                                boundary.global_sha256())
                self._after_round(self._close_round(outcome, checkpoint, **facts), dump)
            if self.history.rounds:  # the last round's eval, for watchers
                self.averager.publish_progress(self.diloco.outer_steps, self.step, 0, 0.0,
                                               sha256=self.diloco.global_sha256(),
                                               stats=self._stats(self.history.rounds[-1].train_loss, 0.0))
        finally:  # however training stops, a committed checkpoint is finished and a begun one dropped
            if self.checkpointer is not None:
                self.checkpointer.close()
        return self.history

    def _checkpoint_due(self) -> bool:
        return self.checkpointer is not None and (self.diloco.round + 1) % self.cfg.checkpoint.every == 0

    def _settle(self, exchange: Exchange) -> float:
        """diloco.delay: commit or discard the round of the exchange in flight, waiting for it if need be;
        returns the seconds this took (the inner steps stood still)."""
        start = time.perf_counter()
        outcome, wait_s = exchange.result()
        if outcome.averaged is not None:
            self.samples_since_commit -= exchange.samples  # what the inner steps since then add stays
        record = self._close_round(outcome, self._checkpoint_due(), exchange=exchange, wait_s=wait_s,
                                   launch_s=exchange.launch_s, **exchange.facts)
        self._after_round(record, exchange.dump)
        return time.perf_counter() - start

    def _after_round(self, record: RoundRecord, dump: Optional[tuple]) -> None:
        if dump is not None:
            dump_round(self.out_dir / "tensors", len(self.history.rounds), record, dump, self.diloco)
        if self.on_round is not None:
            self.on_round(record)

    def _recover_from_non_finite(self, losses: list[float]) -> None:
        """The local model went NaN/Inf: stop announcing readiness, take the swarm's state or stop (SwarmError)."""
        log.warning("round %d: the local model is not finite (last loss %s): taking the swarm's state",
                    self.diloco.round + 1, losses[-1] if losses else "-")
        self.averager.publish_progress(self.diloco.outer_steps, self.step, 0, 0.0, ready=False,
                                       sha256=self.diloco.global_sha256())
        self.history.events.append({"event": "non_finite_model", "time": time.time(), "round": self.diloco.round})
        try:
            self.catch_up(must=True)
        except SwarmError as e:
            raise SwarmError(f"round {self.diloco.round + 1}: the local model is not finite and {e}") from e
        self.samples_since_commit = 0

    def _publish_progress(self, start: float, losses: list[float], ready: bool = False) -> None:
        samples_per_s = len(losses) * self.cfg.data.batch_size / max(1e-9, time.perf_counter() - start)
        self.averager.publish_progress(self.diloco.outer_steps, self.step, self.samples_since_commit, samples_per_s,
                                       ready, self.diloco.global_sha256(), self._stats(losses[-1], samples_per_s))

    def _stats(self, loss: Optional[float], samples_per_s: float) -> PeerStats:
        """What watchers see (`swarm monitor`): the last loss and speed, all-reduce bytes so far, the last eval."""
        rounds, (eval_round, eval_loss) = self.history.rounds, self.last_eval or (None, None)
        return PeerStats(loss, samples_per_s * self.cfg.data.seq_len, sum(r.bytes_sent for r in rounds),
                         sum(r.bytes_received for r in rounds), eval_loss, eval_round)

    def _hold(self, round: int) -> None:
        """`faults.hold_round`: wait while `faults.hold_file` exists before working towards `round` (0: before
        joining the swarm). A held peer that already takes part stays live and serves its state."""
        faults = self.cfg.faults
        if faults.hold_round != round or not os.path.exists(faults.hold_file):
            return
        log.warning("fault injection: holding before round %d while %s exists", round, faults.hold_file)
        if round > 0:
            self.averager.publish_progress(self.diloco.outer_steps, self.step, self.samples_since_commit, 0.0,
                                           sha256=self.diloco.global_sha256())
        while os.path.exists(faults.hold_file):
            time.sleep(0.2)
        log.info("fault injection: released before round %d", round)

    def _inject_faults(self, round: int, inner_step: int, stopping_early: bool = False) -> None:
        """`faults` config: sleep like a slow peer, SIGKILL this process or turn its local model NaN halfway
        through the inner steps of `round` (or where it cuts that round short, if that comes first)."""
        faults = self.cfg.faults
        if faults.step_delay > 0 and not stopping_early:
            time.sleep(faults.step_delay)
        halfway = inner_step == self.cfg.diloco.inner_steps // 2 or stopping_early
        if faults.kill_phase == "inner" and faults.kill_round == round and halfway \
                and faults.kill_rank in (None, self.ranks.rank):
            log.warning("fault injection: killing this peer (SIGKILL) in round %d", round)
            os.kill(os.getpid(), signal.SIGKILL)
        if faults.nan_round == round and halfway and not any(
                e["event"] == "non_finite_model" for e in self.history.events):  # once
            log.warning("fault injection: the local model turns NaN in round %d", round)
            with torch.no_grad():
                self.diloco.params[0].fill_(float("nan"))

    @torch.no_grad()
    def _evaluate_global(self, local_differs: bool) -> float:
        """Held-out loss of the global parameters (what the swarm committed). After a blocking outer step the local
        model is them; after a delayed one it also holds the inner steps taken since (swarm/overlap.py), and with
        fragments those taken since the other fragments landed: it is then set aside meanwhile."""
        if not local_differs:
            return evaluate(self.model, self.eval_batches, self.device, self.precision)
        local = [p.detach().clone() for p in self.diloco.params]
        for p, g in zip(self.diloco.params, self.diloco.global_params):
            p.copy_(g)
        try:
            return evaluate(self.model, self.eval_batches, self.device, self.precision)
        finally:
            for p, saved in zip(self.diloco.params, local):
                p.copy_(saved)

    def _close_round(self, outcome: RoundOutcome, checkpoint: bool, train_loss: float, compute_s: float,
                     tokens_per_s: float, start: float, exchange: Optional[Exchange] = None,
                     wait_s: float = 0.0, launch_s: float = 0.0) -> RoundRecord:
        """Commit the round (outer step; with `exchange`, a delayed round: the local model keeps the inner steps
        taken since, see swarm/overlap.py), or take the swarm's state, or discard it and keep local progress."""
        committed, close_start = outcome.averaged is not None, time.perf_counter()
        if checkpoint and exchange is None and not committed:
            self.checkpointer.abort()
        if committed:
            self._settle_checkpoint()
            if exchange is None:
                self.fragments.boundary.outer_step(outcome.averaged)
                self.samples_since_commit = 0
            else:
                exchange.land(self.fragments.boundary, outcome.averaged)
            self.error_feedback = outcome.residual if self.cfg.swarm.error_feedback else None
        elif exchange is not None:
            exchange.drop(self.fragments.boundary)
        if not committed and outcome.behind:
            log.warning("round %d: %s", self.diloco.round + 1, outcome.note)
            self.catch_up(outcome.donors or None)
        elif not committed:
            log.warning("round %d discarded (%s): keeping local progress for the next attempt",
                        self.diloco.round + 1, outcome.note)
        eval_loss, eval_start = None, time.perf_counter()
        if committed and self.diloco.round % self.cfg.diloco.eval_every == 0:
            eval_loss = self._evaluate_global(local_differs=exchange is not None or self.cfg.diloco.fragments > 1)
            self.last_eval = (self.diloco.round, eval_loss)
        eval_s = time.perf_counter() - eval_start
        record = RoundRecord(
            round=self.diloco.round, committed=committed, train_loss=train_loss, eval_loss=eval_loss,
            global_sha256=self.diloco.global_sha256(), group_size=outcome.group_size,
            samples=outcome.total_samples, compute_s=compute_s, comm_s=outcome.comm_s,
            allreduce_s=outcome.allreduce_s,
            bytes_sent=outcome.bytes_sent, bytes_received=outcome.bytes_received,
            tokens_per_s=tokens_per_s, note=outcome.note, time=time.time(), eval_s=eval_s, wait_s=wait_s,
            start_time=time.time() - (time.perf_counter() - start),
        )
        self.fragments.fold_into(record)  # diloco.fragments: the round's mid-round exchanges
        self.history.rounds.append(record)
        if checkpoint and committed:  # the rest goes to disk while the next round's inner steps run
            inner, rest, meta = self._checkpoint_parts()
            if exchange is not None:  # mid-round: the moments must be on disk before the next inner step
                self.checkpointer.begin(inner)
                self.checkpointer.wait_begun()
            self.checkpointer.commit(rest, meta)
        if committed:
            self.serve_state()
        if exchange is None:
            record.overhead_s = max(0.0, time.perf_counter() - start - compute_s - record.comm_s)
        else:  # the snapshot and launch of the exchange, then this close
            record.overhead_s = launch_s + time.perf_counter() - close_start
        if committed:
            log.info("round %d committed: train loss %.4f, eval loss %s, group %d, %.0f tokens/s, compute %.1fs, "
                     "comm %.2fs, overhead %.2fs, global %s", record.round, train_loss,
                     "-" if eval_loss is None else f"{eval_loss:.4f}", outcome.group_size, tokens_per_s, compute_s,
                     outcome.comm_s, record.overhead_s, record.global_sha256[:12])
        return record
