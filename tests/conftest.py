"""Shared helpers: a tiny config that trains in seconds, a way to run the `swarm` CLI, and a solo run stopped
after a round and resumed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from swarm.averaging import RoundOutcome, SoloAverager
from swarm.config import Config
from swarm.configfile import load_config

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(**sections) -> Config:
    """configs/tiny.yaml shrunk to a model and data that train in a second or two."""
    overrides = {
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 32},
        "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 2, "max_documents": 60},
        "inner": {"warmup_steps": 2},
        "diloco": {"rounds": 3, "inner_steps": 4, "delay": 0, "threads": 1},  # overlap: where a test asks for it
        "logging": {"progress_bar": False},
    }
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    return load_config(ROOT / "configs" / "tiny.yaml", overrides)


def run_cli(*args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarm.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def tiny() -> Config:
    return tiny_config()


class Interrupt(Exception):
    pass


def resumed_after(cfg: Config, out_dir: Path, stop_round: int):
    """A solo Trainer stopped (by an exception, as a crash would) once round `stop_round` committed, then a
    fresh Trainer on the same folder trained to the end: returned, to compare with an uninterrupted run."""
    from swarm.averaging import SoloAverager
    from swarm.trainer import Trainer

    def stop(record) -> None:
        if record.round == stop_round:
            raise Interrupt

    with pytest.raises(Interrupt):
        Trainer(cfg, SoloAverager(), "b", shard=0, out_dir=out_dir, on_round=stop).train()
    resumed = Trainer(cfg, SoloAverager(), "b", shard=0, out_dir=out_dir)
    resumed.train()
    return resumed


class DiscardsOnce(SoloAverager):
    """Discards the first exchange keyed `round` (the outer steps committed before it: with diloco.fragments,
    one per committed fragment exchange), as a group that lost a member would."""

    def __init__(self, round: int):
        self.round, self.discarded = round, False

    def average(self, round, pseudo_grad, samples, out, base=""):
        if round == self.round and not self.discarded:
            self.discarded = True
            return RoundOutcome(None, note="injected discard")
        return super().average(round, pseudo_grad, samples, out, base)
