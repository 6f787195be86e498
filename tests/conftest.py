"""Shared helpers: a tiny config that trains in seconds, and a way to run the `swarm` CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from swarm.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(**sections) -> Config:
    """configs/tiny.yaml shrunk to a model and data that train in a second or two."""
    overrides = {
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 32},
        "data": {"seq_len": 32, "batch_size": 4, "eval_batches": 2, "max_documents": 60},
        "inner": {"warmup_steps": 2},
        "diloco": {"rounds": 3, "inner_steps": 4, "threads": 1},
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
