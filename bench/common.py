"""Shared helpers of the benchmarks: the tiny config, markdown tables, timestamps, child processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import yaml

from swarm.config import Config
from swarm.data.batches import TrainBatches, load_corpus
from swarm.run.configfile import load_config
from swarm.train.inner import evaluate, lr_lambda
from swarm.train.model import build_model

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"  # full runs (`make bench`): committed
QUICK_RESULTS = REPO / "runs" / "bench-quick"  # quick runs (`make bench-quick`): never over the committed results


def results_dir(quick: bool) -> Path:
    return QUICK_RESULTS if quick else RESULTS
TINY_YAML = REPO / "configs" / "tiny.yaml"


def commit() -> str:
    """The commit the benchmarks run on: `SWARM_COMMIT` where the tree has no git (a copy sent to a GPU host), else
    git's HEAD, marked "+changes" when tracked files differ from it (such a table is not from one commit)."""
    if os.environ.get("SWARM_COMMIT"):
        return os.environ["SWARM_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              cwd=REPO, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def tiny_config(steps: int, inner_steps: int, outer_lr: float = 0.7, **sections: dict) -> Config:
    """The notes' tiny reference: configs/tiny.yaml with 2 layers (0.43M parameters), batch 8x128, inner lr 1e-3,
    `steps` inner steps per worker in rounds of `inner_steps`, blocking; no checkpoints, no progress bar."""
    rounds = max(1, steps // inner_steps)
    values: dict[str, Any] = {
        "model": {"num_layers": 2},
        "inner": {"lr": 1e-3, "warmup_steps": min(20, rounds * inner_steps)},
        "outer": {"lr": outer_lr},
        "diloco": {"rounds": rounds, "inner_steps": inner_steps, "eval_every": eval_every(rounds), "threads": 1,
                   "delay": 0},  # blocking rounds unless a bench point sets diloco.delay
        "checkpoint": {"every": 0},
        "logging": {"progress_bar": False},
    }
    for name, fields in sections.items():
        values.setdefault(name, {}).update(fields)
    return load_config(TINY_YAML, values)


def eval_every(rounds: int, points: int = 8) -> int:
    """The largest divisor of `rounds` that still gives about `points` evals (the last round is always one)."""
    return max(k for k in range(1, rounds + 1) if rounds % k == 0 and rounds // k >= min(points, rounds))


def train_plain(cfg: Config, shards: list[int], steps: int,
                eval_points: int = 8) -> tuple[list[tuple[int, float]], float]:
    """The loop anyone would write: AdamW with the trainer's schedule and clipping; each step averages the
    gradients of one batch from each shard (one shard: a single worker; M shards: synchronous data parallel with
    an M x B global batch). Returns the held-out eval curve [(step, loss)] and the training seconds (evals
    excluded); eval_points=0: no evals."""
    corpus = load_corpus(cfg.data)
    batches = [TrainBatches(corpus, cfg.data, s) for s in shards]
    evals = corpus.eval_batches(cfg.data)
    model = build_model(cfg.model, corpus.tokenizer.vocab_size)
    inner = cfg.inner
    opt = torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=inner.eps,
                            weight_decay=inner.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(inner, steps))
    every = max(1, steps // eval_points) if eval_points else steps + 1
    curve, seconds = [(0, evaluate(model, evals, "cpu"))] if eval_points else [], 0.0
    for step in range(steps):
        start = time.perf_counter()
        batch = torch.cat([b.batch(step) for b in batches])  # mean over M equal batches = mean of M gradients
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - start
        if eval_points and ((step + 1) % every == 0 or step + 1 == steps):
            curve.append((step + 1, evaluate(model, evals, "cpu")))
    return curve, seconds


def write_config(cfg: Config, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def spawn(argv: list[str], log_path: Path, prefix: Optional[list[str]] = None) -> subprocess.Popen:
    """A child in its own process group (so `stop` reaches its DHT and p2pd children), output to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        return subprocess.Popen([*(prefix or []), sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=REPO, start_new_session=True)


def stop(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM each live child, wait up to `grace`, then SIGKILL each child's process group."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.time()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The first line of `path` that contains `pattern` (re.search), waiting for it up to `timeout` s."""
    import re

    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                found = re.search(pattern, line)
                if found:
                    return found.group(0)
        if proc.poll() is not None:
            raise RuntimeError(f"{path.name}: the process exited ({proc.returncode}) before printing {pattern!r}")
        time.sleep(0.2)
    raise RuntimeError(f"{path.name}: no {pattern!r} within {timeout:g} s")
