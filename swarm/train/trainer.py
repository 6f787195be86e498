"""The DiLoCo two-level loop for one peer, top to bottom: rounds, then H inner steps, then the outer step.

The inner loop is plain PyTorch (AdamW, warmup + cosine, grad clipping) and never sees the DHT. The swarm is
reached through the `Averager` only: an exchange of a fragment's pseudo-gradient (`Exchange`) where the schedule
says (swarm/train/fragments.py: with one fragment and no delay, once at the round's end), progress reports, and states
taken or served. `_settle` is the one place that decides what an exchange's outcome means, for every mode
(blocking or delayed, one fragment or several): commit (outer step applied, hash recorded, state served, and
for a round's last fragment the round closed and checkpointed), discard (the local model keeps its inner
progress and the fragment's next exchange covers both), or take the swarm's state (found behind). A peer whose
local model went NaN/Inf takes the swarm's state too; if no peer can give it, it stops (SwarmError) rather than
train on from a stale state. The words: swarm/__init__.py.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from swarm.config import Config
from swarm.data.batches import TrainBatches, check_vocabulary, load_corpus
from swarm.data.peerdata import Leases, PeerData
from swarm.errors import SwarmError
from swarm.run.metrics import Metrics
from swarm.state import peerstate as peer_state
from swarm.state.checkpoint import CorruptCheckpoint
from swarm.state.peerstate import Position
from swarm.tensors import Buffers, swapped
from swarm.train.averaging import Averager, ExchangeOutcome, PeerStats
from swarm.train.diloco import DiLoCo
from swarm.train.fragments import Fragment, Fragments
from swarm.train.history import ExchangeCost, PeerHistory, RoundFacts, RoundRecord, dump_round, round_inputs
from swarm.train.inner import autocast, build_optimizer, evaluate, forward_backward, lr_lambda
from swarm.train.model import build_model, count_parameters
from swarm.train.overlap import Exchange
from swarm.train.ranks import SINGLE, Ranks
from swarm.train.sharding import Shards, shard_model, shards_model
from swarm.train.trainer_state import Parts, Progress, StateKeeper

log = logging.getLogger("swarm.trainer")
NON_FINITE_TRIES = 3  # states taken in a row after the local model went NaN/Inf before a peer gives up


class Trainer:
    """One peer's model, inner optimizer, DiLoCo state and data, with save/restore of all of it."""

    def __init__(self, cfg: Config, averager: Averager, peer_id: str, shard: Optional[int], out_dir: Path,
                 on_round: Optional[Callable[[RoundRecord], None]] = None, ranks: Ranks = SINGLE,
                 name: Optional[str] = None, leases: Optional[Leases] = None):
        """`shard`: this peer's data shard, None for one leased through the swarm (`leases`, on rank 0); `name`:
        the identity that seeds its batch order (default `peer_id`), stable across restarts (swarm/data/peerdata.py)."""
        self.cfg, self.averager, self.on_round, self.out_dir, self.ranks = cfg, averager, on_round, out_dir, ranks
        self.device = cfg.diloco.device
        self.corpus = corpus = load_corpus(cfg.data)
        check_vocabulary(corpus.tokenizer, cfg.model.vocab_size, cfg.data)
        self.data = PeerData(corpus, cfg.data, name or peer_id, shard, cfg.swarm.run_id, ranks, leases)
        self.eval_batches = corpus.eval_batches(cfg.data)
        # inner.parallel fsdp over K > 1 ranks: FSDP2 shards the model before its weights exist, each rank makes
        # its own rows only, and DiLoCo holds this rank's rows only
        sharded = shards_model(cfg.inner.parallel, ranks.world_size)
        self.model = build_model(cfg.model, corpus.tokenizer.vocab_size, cfg.data.tokenizer, self.device,
                                 shard=shard_model if sharded else None)
        shards = Shards.of(self.model, ranks.rank, ranks.world_size, ranks.cpu_group, out_dir / "shards") \
            if sharded else None
        self.diloco = DiLoCo(self.model, cfg.outer, cfg.diloco.global_device, cfg.diloco.mix_alpha, shards)
        self.fragments = Fragments(self.diloco, cfg.diloco)  # the exchanges' schedule (one fragment: the round's)
        self.exchange: Optional[Exchange] = None  # the exchange in flight (diloco.delay): never more than one
        self.closing: Optional[RoundFacts] = None  # what the round the exchange in flight closes measured
        self.cost = ExchangeCost()  # the exchanges settled since the last round closed
        self.stall_s = 0.0  # this round's inner steps so far, waiting for a checkpoint's moments (inner_step)
        self.precision = autocast(cfg.inner.precision, self.device)
        self.optimizer = build_optimizer(self.model, cfg)
        self.train_model = ranks.wrap(self.model, sharded)  # DDP over the peer's ranks, or the model itself
        total = cfg.diloco.rounds * cfg.diloco.inner_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg.inner, total))
        self.progress = Progress(PeerHistory(peer_id=peer_id), [0] * len(self.fragments.all))
        self.last_eval: Optional[tuple[int, float]] = None  # (round, held-out loss), shown to watchers
        self.non_finite_tries = 0  # states taken since the last committed round because the local model went bad
        self.state = StateKeeper(Parts(cfg, self.model, self.diloco, self.fragments, self.optimizer, ranks, averager,
                                       corpus, self.data, out_dir), self.progress, self._set_position)
        self.metrics = Metrics(cfg, out_dir, peer_id) if ranks.endpoint else None  # metrics.csv, TensorBoard, W&B
        log.info("peer %s: %d parameters, data shard %s, %d rounds x %d inner steps", peer_id, count_parameters(
            self.model), "leased" if shard is None else shard, cfg.diloco.rounds, cfg.diloco.inner_steps)

    @property
    def checkpointer(self):  # the keeper's: the trainer begins, commits and closes the checkpoints it writes
        return self.state.checkpointer

    @property
    def batches(self) -> Optional[TrainBatches]:  # the shard read now and the position there; None before training
        return self.data.batches

    # ---- state: the named tensors of swarm/state/peerstate.py, in checkpoints and for newcomers ------------------
    def _set_position(self, position: Position) -> None:
        """Stand at `position`; the learning-rate schedule follows its step. The local model restarts: no local
        progress to count. Only ever called with no exchange in flight (a state is taken once the exchange that
        found us behind settled)."""
        assert self.exchange is None, "a position is set with an exchange in flight"
        step = position.step
        self.diloco.round, self.progress.step, self.progress.inner = position.round, step, position.inner
        self.diloco.outer_steps = position.outer_steps
        self.progress.samples = [0] * len(self.fragments.all)
        self.scheduler.last_epoch, self.scheduler._step_count = step, step + 1
        lrs = [base * fn(step) for base, fn in zip(self.scheduler.base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler._last_lr = lrs
        peer_state.set_optimizer_step(self.optimizer, step)

    # ---- the loop ------------------------------------------------------------------------------------
    def inner_step(self) -> float:
        batch = self.data.next_batch()
        mine = self.ranks.slice(batch).to(self.device)
        loss = forward_backward(self.train_model, mine, self.cfg.inner.micro_batch_size or len(mine), self.precision)
        loss = self.ranks.mean(loss)
        if self.cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        if self.checkpointer is not None:  # a begun checkpoint may still be writing the moments step() changes
            self.stall_s += self.checkpointer.wait_begun()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self.progress.inner += 1
        self.progress.samples = [s + batch.shape[0] for s in self.progress.samples]
        return loss.item()

    def train(self, on_step: Optional[Callable[[int, int, float], None]] = None) -> PeerHistory:
        """Join the swarm (resume, or take its state), then train round after round until `diloco.rounds` are
        committed. `on_step(round, inner step, loss)` is called after every inner step."""
        self._join()
        try:
            while True:
                if self.exchange is not None and self.diloco.round + 1 == self.cfg.diloco.rounds:
                    self._settle()  # the last round's exchange: no inner steps left to hide it behind
                if self.diloco.round >= self.cfg.diloco.rounds:
                    break
                if self.progress.history.rounds:
                    self.data.renew()  # a lease may have moved to an earlier claimant
                self._train_round(on_step)
                self.progress.history.data = self.data.report()
            if self.progress.history.rounds:  # the last round's eval, for watchers
                self.averager.publish_progress(self.diloco.outer_steps, self.progress.step, 0, 0.0,
                                               sha256=self.diloco.global_sha256(),
                                               stats=self._stats(self.progress.history.rounds[-1].train_loss, 0.0))
            self.state.finish()
        finally:  # however training stops, a committed checkpoint is finished and a begun one dropped
            if self.checkpointer is not None:
                self.checkpointer.close()
            if self.metrics is not None:
                self.metrics.close()
        return self.progress.history

    def _join(self) -> None:
        """Resume from this peer's checkpoint (a corrupt one, in a swarm: from the swarm's state), take the swarm's
        state if it is ahead, and measure the loss training starts from."""
        self._hold(0)
        try:
            self.state.resume()
        except CorruptCheckpoint as e:
            if not self.averager.networked:
                raise
            log.warning("%s; falling back to the state of peers", e)
            self.progress.history.events.append({"event": "corrupt_checkpoint", "time": time.time(), "error": str(e)})
        self.data.take()
        self.progress.history.data = self.data.report()
        self.state.catch_up()
        if self.progress.history.initial_eval_loss is None:
            self.progress.history.initial_eval_loss = self._eval()
            self.last_eval = (self.diloco.round, self.progress.history.initial_eval_loss)
            log.info("round %d: eval loss %.4f (before training)", *self.last_eval)

    def _train_round(self, on_step: Optional[Callable[[int, int, float], None]]) -> None:
        """One round: H inner steps on this peer's shard with the exchanges the schedule puts between them, then
        the exchange of the last fragment, which closes the round. A straggler stops early once a faster peer
        waits to average, and contributes the steps it has (the average is weighted by samples)."""
        cfg = self.cfg.diloco
        round = self.diloco.round + 1 + (self.exchange is not None)  # the last round may still be landing
        self._hold(round)
        start = time.perf_counter()
        inner_start, paused, losses, last_report, self.stall_s = time.perf_counter(), 0.0, [], 0.0, 0.0
        while self.progress.inner < cfg.inner_steps and self.diloco.round < cfg.rounds:
            self._inject_faults(round, self.progress.inner)
            losses.append(self.inner_step())
            if on_step is not None:
                on_step(self.diloco.round, self.progress.inner, losses[-1])
            if time.perf_counter() - last_report >= self.cfg.swarm.progress_interval:
                last_report = time.perf_counter()
                self._publish_progress(inner_start, losses, ready=self.exchange is not None)
            paused += self._run_due(self.fragments.due(self.progress.inner))  # a state taken may move the position
            if self._stops_early(round):
                break
        compute_s = time.perf_counter() - inner_start - paused - self.stall_s
        if self.exchange is not None:  # a round cut short before the exchange in flight landed
            self._settle()
        if self.diloco.round >= cfg.rounds:  # a state taken meanwhile ended the run
            return
        self.progress.inner = 0  # the next round's, unless a state taken at the round's close says otherwise
        finite = all(map(math.isfinite, losses)) and self.diloco.pseudo_gradient().is_finite()
        if self.diloco.shards is not None:  # each rank sees its own rows: the peer's model is finite if all are
            finite = self.diloco.shards.all_true(finite)
        if not finite:
            self._recover_from_non_finite(losses)
            return
        self._publish_progress(inner_start, losses, ready=True)
        tokens = self.cfg.data.batch_size * self.cfg.data.seq_len * len(losses)
        self.closing = RoundFacts(train_loss=sum(losses) / len(losses), compute_s=compute_s, start=start,
                                  tokens_per_s=tokens / compute_s, stall_s=self.stall_s)
        self._launch(self.fragments.last)
        if not self.exchange.delayed:
            self._settle()

    def _run_due(self, events: list[tuple[str, Fragment]]) -> float:
        """Land and start the exchanges due after this inner step; returns the seconds the inner steps stood
        still. A landing that takes the swarm's state ends the list: the schedule goes on from the new position."""
        start = time.perf_counter()
        for action, fragment in events:
            if action == "start":
                self._launch(fragment)
            elif self.exchange is not None and self.exchange.fragment is fragment and not self._settle():
                break
        return time.perf_counter() - start

    def _stops_early(self, round: int) -> bool:
        """A straggler's round ends here (peers wait to average, or the swarm moved past it: `Averager.round_over`),
        once every mid-round exchange has landed."""
        done, cfg = self.progress.inner, self.cfg.diloco
        if done >= cfg.inner_steps or self.exchange is not None or not self.fragments.may_stop_early(done):
            return False
        if not self.ranks.share(self.averager.round_over(self.diloco.outer_steps)):
            return False
        log.info("round %d ends early (peers wait to average, or the swarm moved on): contributing %d of %d inner "
                 "steps", round, done, cfg.inner_steps)
        self._inject_faults(round, done, stopping_early=True)
        return True

    def _launch(self, fragment: Fragment) -> None:
        """Start `fragment`'s exchange (the last fragment's closes the round: it carries the error feedback, and a
        blocking one writes the AdamW moments of a due checkpoint to disk while it averages)."""
        closes, delayed = fragment is self.fragments.last, self.cfg.diloco.delay > 0
        if closes and not delayed and self._checkpoint_due():
            self.checkpointer.begin(self.state.checkpoint_parts()[0])
        self.exchange = Exchange(fragment, self.averager, self.progress.samples[fragment.index],
                                 self.progress.error_feedback if closes else None, delayed,
                                 self._average_buffers(fragment))
        if closes and self.cfg.logging.dump_tensors and self.ranks.endpoint:
            self.closing.dump = round_inputs(self.exchange.pseudo_grad, self.exchange.samples, self.diloco)

    def _average_buffers(self, fragment: Fragment) -> Sequence[torch.Tensor] | Buffers:
        """Where an exchange's average lands: a sharded peer's goes through a node-local file (`Fragment.wire`) and
        none here; rank 0 of a replicated peer hands fp32 tensors on; else the averager's own (a networked peer's
        keeps the wire's bytes until the outer step reads them)."""
        if self.diloco.shards is not None:
            return []
        if self.ranks.distributed:
            return fragment.outer_grads()
        return self.averager.result_buffers([g.shape for g in fragment.global_params])

    def _settle(self) -> bool:
        """The one decision point: wait for the exchange in flight and commit it (land its outer step), discard it
        (drop it: the local model keeps its progress) or, found behind, take the swarm's state. Every rank of a
        multi-process peer takes rank 0's outcome here. The last fragment's exchange then closes the round.
        Returns False if the swarm's state was taken (the position moved)."""
        exchange, self.exchange = self.exchange, None
        fragment, closes = exchange.fragment, exchange.fragment is self.fragments.last
        checkpoint = closes and self._checkpoint_due()
        outcome, wait_s = exchange.result()
        outcome = self.ranks.share_outcome(outcome, exchange.out, fragment.unwire if self.diloco.shards else None)
        settle_start, committed = time.perf_counter(), outcome.averaged is not None
        self.cost.add(outcome.comm_s, outcome.allreduce_s, wait_s, outcome.bytes_sent, outcome.bytes_received)
        where = f"round {self.diloco.round + 1}" + (f": fragment {fragment.index}" if not closes else "")
        if checkpoint and not committed and not exchange.delayed:
            self.checkpointer.abort()
        if committed:
            self.state.settle_checkpoint()
            exchange.land(outcome.averaged)
            self.progress.samples[fragment.index] -= exchange.samples  # what the inner steps since its start add stays
            if closes:
                self.progress.error_feedback = outcome.residual if self.cfg.swarm.error_feedback else None
        else:
            exchange.drop()
        if not committed and outcome.behind:
            log.warning("%s: %s", where, outcome.note)
            self.state.catch_up(outcome.donors or None)
        elif not committed:
            log.warning("%s: exchange discarded (%s): keeping local progress for the next one", where, outcome.note)
            if not closes:
                self.progress.history.events.append({"event": "fragment_discarded", "time": time.time(), "round":
                                            self.diloco.round, "fragment": fragment.index, "note": outcome.note})
        if closes:
            self._close_round(exchange, outcome, checkpoint, settle_start)
        elif committed:
            self.state.serve_state()
        return committed or not outcome.behind

    def _checkpoint_due(self) -> bool:
        return self.checkpointer is not None and (self.diloco.round + 1) % self.cfg.checkpoint.every == 0

    def _recover_from_non_finite(self, losses: list[float]) -> None:
        """The local model went NaN/Inf: stop announcing readiness and take the swarm's state; SwarmError if no
        peer can give it, or if the model went non-finite `NON_FINITE_TRIES` times in a row without a round
        committed in between (the state the swarm serves is itself poisoned: taking it again would loop)."""
        round = self.diloco.round + 1
        log.warning("round %d: the local model is not finite (last loss %s): taking the swarm's state",
                    round, losses[-1] if losses else "-")
        self.averager.publish_progress(self.diloco.outer_steps, self.progress.step, 0, 0.0, ready=False,
                                       sha256=self.diloco.global_sha256())
        self.progress.history.events.append({"event": "non_finite_model", "time": time.time(),
                                             "round": self.diloco.round})
        self.non_finite_tries += 1
        if self.non_finite_tries > NON_FINITE_TRIES:
            donors = [e["donor"] for e in self.progress.history.events if e["event"] == "state_downloaded"]
            raise SwarmError(f"round {round}: the local model went non-finite {self.non_finite_tries} times in a row, "
                             f"the last after taking the state of {donors[-1] if donors else 'no peer'}")
        try:
            self.state.catch_up(must=True)
        except SwarmError as e:
            raise SwarmError(f"round {round}: the local model is not finite and {e}") from e

    def _publish_progress(self, start: float, losses: list[float], ready: bool = False) -> None:
        samples_per_s = len(losses) * self.cfg.data.batch_size / max(1e-9, time.perf_counter() - start)
        self.averager.publish_progress(self.diloco.outer_steps, self.progress.step, self.progress.samples[-1],
                                       samples_per_s, ready, self.diloco.global_sha256(),
                                       self._stats(losses[-1], samples_per_s))

    def _stats(self, loss: Optional[float], samples_per_s: float) -> PeerStats:
        """What watchers see (`swarm monitor`): the last loss and speed, all-reduce bytes so far, the last eval."""
        rounds, (eval_round, eval_loss) = self.progress.history.rounds, self.last_eval or (None, None)
        return PeerStats(loss, samples_per_s * self.cfg.data.seq_len, sum(r.bytes_sent for r in rounds),
                         sum(r.bytes_received for r in rounds), eval_loss, eval_round)

    def _hold(self, round: int) -> None:
        """`faults.hold_round`: wait while `faults.hold_file` exists before working towards `round` (0: before
        joining the swarm). A held peer that already takes part stays live and serves its state."""
        faults = self.cfg.faults
        if faults.hold_round != round or not os.path.exists(faults.hold_file):
            return
        log.warning("holding before round %d while %s exists (faults.hold_round)", round, faults.hold_file)
        if round > 0:
            self.averager.publish_progress(self.diloco.outer_steps, self.progress.step, self.progress.samples[-1], 0.0,
                                           sha256=self.diloco.global_sha256())
        while os.path.exists(faults.hold_file):
            time.sleep(0.2)
        log.info("released before round %d (faults.hold_round)", round)

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
                e["event"] == "non_finite_model" for e in self.progress.history.events):  # once
            log.warning("fault injection: the local model turns NaN in round %d", round)
            with torch.no_grad():
                self.diloco.params[0].fill_(float("nan"))

    def _eval(self) -> float:
        """Held-out loss of the local model, in micro-batches of `inner.micro_batch_size` like an inner step."""
        return evaluate(self.model, self.eval_batches, self.device, self.precision, self.cfg.inner.micro_batch_size)

    @torch.no_grad()
    def _evaluate_global(self, local_differs: bool) -> float:
        """Held-out loss of the global parameters (what the swarm committed). After a blocking outer step the local
        model is them; after a delayed one it also holds the inner steps taken since (swarm/train/overlap.py), and with
        fragments those taken since the other fragments landed: it is then set aside meanwhile."""
        if not local_differs:
            return self._eval()
        if self.diloco.shards is None:  # the parameters take the global tensors' storage for the eval, without a copy
            local = [p.data for p in self.diloco.params]  # (with a copy where the model has another dtype or device)
            for p, g in zip(self.diloco.params, self.diloco.global_params):
                p.data = g.to(p.device, p.dtype)
            try:
                return self._eval()
            finally:
                for p, saved in zip(self.diloco.params, local):
                    p.data = saved
        # A sharded peer's rows are views of FSDP's own shards, which its forward gathers from: the rows trade
        # values with the global ones for the eval. The checkpoint being written still reads the global rows.
        self.state.settle_checkpoint()
        with swapped(self.diloco.params, self.diloco.global_params):
            return self._eval()

    def _close_round(self, exchange: Exchange, outcome: ExchangeOutcome, checkpoint: bool, close_start: float) -> None:
        """The round's last exchange settled (`_settle`): evaluate the committed global parameters, record the round
        with the communication of all its exchanges, finish its checkpoint and tell `on_round`."""
        committed, facts = outcome.averaged is not None, self.closing
        eval_loss, eval_start = None, time.perf_counter()
        if committed and self.diloco.round % self.cfg.diloco.eval_every == 0:
            eval_loss = self._evaluate_global(local_differs=exchange.delayed or self.fragments.streaming)
            self.last_eval = (self.diloco.round, eval_loss)
        eval_s = time.perf_counter() - eval_start
        record = RoundRecord(
            round=self.diloco.round, committed=committed, train_loss=facts.train_loss, eval_loss=eval_loss,
            global_sha256=self.diloco.global_sha256(), group_size=outcome.group_size,
            samples=outcome.total_samples, compute_s=facts.compute_s, **dataclasses.asdict(self.cost),
            tokens_per_s=facts.tokens_per_s, note=outcome.note, time=time.time(), eval_s=eval_s,
            start_time=time.time() - (time.perf_counter() - facts.start),
        )
        self.cost = ExchangeCost()
        self.progress.history.rounds.append(record)
        if committed:
            self.non_finite_tries = 0
        if checkpoint and committed:  # the rest goes to disk while the next round's inner steps run
            inner, rest, meta = self.state.checkpoint_parts()
            if exchange.delayed:  # mid-round: written while the next inner step's forward and backward run
                self.checkpointer.begin(inner)
            self.checkpointer.commit(rest, meta)
        if committed:
            self.state.serve_state()
        if exchange.delayed:  # taking and launching the exchange, then this close
            record.overhead_s = exchange.launch_s + time.perf_counter() - close_start + facts.stall_s
        else:
            record.overhead_s = max(0.0, time.perf_counter() - facts.start - facts.compute_s - record.comm_s)
        if committed:
            log.info("round %d committed: train loss %.4f, eval loss %s, group %d, %.0f tokens/s, compute %.1fs, "
                     "comm %.2fs, overhead %.2fs, global %s", record.round, record.train_loss,
                     "-" if eval_loss is None else f"{eval_loss:.4f}", outcome.group_size, record.tokens_per_s,
                     record.compute_s, outcome.comm_s, record.overhead_s, record.global_sha256[:12])
        if self.metrics is not None:
            self.metrics.round(record, self.progress.step)
        if facts.dump is not None:
            dump_round(self.out_dir / "tensors", len(self.progress.history.rounds), record, facts.dump, self.diloco)
        if self.on_round is not None:
            self.on_round(record)
