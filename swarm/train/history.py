"""What a peer's rounds leave behind: one `RoundRecord` per committed or discarded round, in `PeerHistory`
(summary.json's per-peer entry is built from it, and checkpoints carry it as a dict)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from swarm.train.diloco import DiLoCo, PseudoGradient


@dataclass
class RoundFacts:
    """What a round measured by the time its closing exchange starts (the round is recorded when it settles)."""

    train_loss: float
    compute_s: float  # its inner steps
    start: float  # time.perf_counter() when its inner steps began
    tokens_per_s: float
    stall_s: float = 0.0  # of the time its inner steps took, waiting for a checkpoint's AdamW moments to be on disk
    dump: Optional[dict[str, Any]] = None  # logging.dump_tensors: the exchange's inputs (`round_inputs`)


@dataclass
class ExchangeCost:
    """What the exchanges settled since the last round closed cost, summed: every fragment's, for the round they
    close."""

    comm_s: float = 0.0  # matchmaking and all-reduce
    allreduce_s: float = 0.0
    wait_s: float = 0.0  # the inner steps stood still for them (delayed exchanges)
    bytes_sent: int = 0
    bytes_received: int = 0

    def add(self, comm_s: float, allreduce_s: float, wait_s: float, bytes_sent: int, bytes_received: int) -> None:
        self.comm_s += comm_s
        self.allreduce_s += allreduce_s
        self.wait_s += wait_s
        self.bytes_sent += bytes_sent
        self.bytes_received += bytes_received


@dataclass
class RoundRecord:
    """What one committed (or discarded) round leaves in the log and in summary.json."""

    round: int  # rounds closed when it was written: the round's number if it committed
    committed: bool
    train_loss: float
    eval_loss: Optional[float]
    global_sha256: str
    group_size: int
    samples: int
    compute_s: float  # inner steps
    comm_s: float  # matchmaking and all-reduce
    bytes_sent: int
    bytes_received: int
    tokens_per_s: float
    note: str = ""
    time: float = 0.0  # unix time when the round closed
    start_time: float = 0.0  # unix time when its inner steps began
    overhead_s: float = 0.0  # the rest of the round: outer step, hashing, eval, checkpoint, state download
    eval_s: float = 0.0  # of overhead_s, the held-out eval
    allreduce_s: float = 0.0  # of comm_s, the all-reduce that committed the round
    wait_s: float = 0.0  # diloco.delay 1: how long the inner steps stopped to wait for this round's exchange


@dataclass
class PeerHistory:
    peer_id: str
    initial_eval_loss: Optional[float] = None
    rounds: list[RoundRecord] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    final_round: int = 0  # the round and hash this peer holds now: committed, resumed or downloaded
    final_global_sha256: Optional[str] = None
    data: dict[str, Any] = field(default_factory=dict)  # swarm/data/peerdata.py report(): shard, samples, overlap

def history_to_dict(history: PeerHistory) -> dict[str, Any]:
    return {**history.__dict__, "rounds": [r.__dict__ for r in history.rounds]}


def history_from_dict(d: dict[str, Any]) -> PeerHistory:
    return PeerHistory(**{**d, "rounds": [RoundRecord(**r) for r in d["rounds"]]})


def round_inputs(pseudo_grad: PseudoGradient, samples: int, diloco: DiLoCo) -> tuple:
    """`logging.dump_tensors`: what a round starts from, taken before its exchange."""
    return pseudo_grad.tensors(), samples, [g.clone() for g in diloco.global_params]


def dump_round(folder: Path, attempt: int, record: RoundRecord, inputs: tuple, diloco: DiLoCo) -> None:
    """Evidence for tests: what this peer contributed and what it committed, per attempt."""
    pseudo_grad, samples, global_before = inputs
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"record": record.__dict__, "pseudo_grad": pseudo_grad, "samples": samples,
                "global_before": global_before, "global_after": [g.clone() for g in diloco.global_params]},
               folder / f"attempt-{attempt:04d}.pt")
