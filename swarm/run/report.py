"""summary.json, metrics.csv and loss.png: what a run leaves behind for people and for other tools.

metrics.csv (one per peer, in its folder) gains a row as each round closes, committed or discarded, and is
only ever appended to: a peer that resumes from its checkpoint adds rows after the old ones (a round trained
again after a crash appears twice, at two times). Columns: `METRICS_COLUMNS`.

summary.json holds `run`, `mode`, `config` (resolved), `wall_s`, `events`, and `peers`: per peer
`peer_id`, `rounds_completed` and `final_global_sha256` (the round and hash it ended on, committed or
downloaded from a peer), `round_hashes` (the state's hash, swarm/state/statehash.py, after each committed round),
`initial_eval_loss`, `train_loss` and `eval_loss` (per committed round), `compute_s`, `comm_s`,
`wait_s` (with diloco.delay: the time inner steps stopped for an exchange that ran behind them; comm_s then
runs in the background), `overhead_s`, `bytes_sent`, `bytes_received` (all-reduce payload, totals),
`peak_rss_bytes` (the peer process's peak resident memory, read by the peer itself), `peak_device_bytes` (the
most its tensors held on its CUDA device; 0 on CPU) and `rounds` (every round record, discarded ones included,
with its own byte counts and `overhead_s`: the round's time outside inner steps and matchmaking + all-reduce).
"""

from __future__ import annotations

import csv
import json
import os
import resource
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from swarm.train.history import PeerHistory, RoundRecord

METRICS_COLUMNS = ["time", "round", "committed", "inner_step", "train_loss", "eval_loss", "tokens_per_s", "compute_s",
                   "comm_s", "wait_s", "overhead_s", "bytes_sent", "bytes_received", "group_size", "samples",
                   "global_sha256"]


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_device_bytes() -> int:
    """The most memory this process's tensors held on its CUDA device so far (0 where it used none)."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0


def peer_summary(history: PeerHistory, nproc: int = 1) -> dict[str, Any]:
    committed = [r for r in history.rounds if r.committed]
    compute_s = sum(r.compute_s for r in history.rounds)
    return {
        "peer_id": history.peer_id,
        "rounds_completed": history.final_round,  # a peer that caught up holds the donor's round
        "round_hashes": [r.global_sha256 for r in committed],
        "final_global_sha256": history.final_global_sha256,
        "initial_eval_loss": history.initial_eval_loss,
        "train_loss": [r.train_loss for r in committed],
        "eval_loss": [r.eval_loss for r in committed],
        "nproc": nproc,  # processes (ranks) training this peer's replica
        # tokens trained over the run / seconds spent in inner steps (all ranks together)
        "tokens_per_s": sum(r.tokens_per_s * r.compute_s for r in history.rounds) / compute_s if compute_s else 0.0,
        "compute_s": compute_s,
        "comm_s": sum(r.comm_s for r in history.rounds),
        "wait_s": sum(r.wait_s for r in history.rounds),
        "overhead_s": sum(r.overhead_s for r in history.rounds),
        "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": peak_device_bytes(),
        "bytes_sent": sum(r.bytes_sent for r in history.rounds),
        "bytes_received": sum(r.bytes_received for r in history.rounds),
        "data": history.data,
        "data_overlap": data_overlap([history.data]),
        "rounds": [r.__dict__ for r in history.rounds],
        "events": history.events,
    }


def data_overlap(data: Iterable[dict[str, Any]]) -> float:
    """Of the samples these peers drew, the share trained while another live peer claimed the same data shard
    (swarm/data/peerdata.py report(): duplicate training; 0 where no peer shared one)."""
    data = [d for d in data if d]
    drawn = sum(d.get("samples", 0) for d in data)
    return sum(d.get("overlap_samples", 0) for d in data) / drawn if drawn else 0.0


def append_metrics(path: Path, record: RoundRecord, inner_step: int) -> None:
    """One row of metrics.csv for a round that just closed, this peer at `inner_step` (its total)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(METRICS_COLUMNS)
        row = {**record.__dict__, "inner_step": inner_step}
        writer.writerow(["" if row[c] is None else row[c] for c in METRICS_COLUMNS])


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def write_summary(out_dir: Path, run: str, mode: str, config: dict, wall_s: float,
                  peers: Iterable[dict[str, Any]], events: list[dict[str, Any]] = (),
                  fault_report: Optional[dict[str, Any]] = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    peers = list(peers)
    summary = {"run": run, "mode": mode, "config": config, "wall_s": wall_s, "events": list(events),
               "peers": peers, "data_overlap": data_overlap(p.get("data", {}) for p in peers)}
    if fault_report:
        summary["fault_report"] = fault_report
    write_json(out_dir / "summary.json", summary)
    plot_losses(out_dir / "loss.png", summary["peers"])
    return out_dir / "summary.json"


def plot_losses(path: Path, peers: list[dict[str, Any]]) -> None:
    """Every peer's train loss per committed round, and the held-out eval loss per round (the same on every
    peer that committed the round, since they hold the same global parameters)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    evals: dict[int, float] = {}
    for peer in peers:
        rounds = [r["round"] for r in peer["rounds"] if r["committed"]]
        name = peer.get("name", peer["peer_id"][:10])
        ax.plot(rounds, peer["train_loss"], marker=".", alpha=0.7, label=f"train {name}")
        evals.update({r: e for r, e in zip(rounds, peer["eval_loss"]) if e is not None})
        if rounds and peer.get("initial_eval_loss") is not None:
            evals.setdefault(rounds[0] - 1, peer["initial_eval_loss"])  # before its first round here
    if evals:
        ax.plot(*zip(*sorted(evals.items())), marker="o", color="black", linestyle="--", label="eval (held out)")
    ax.set_xlabel("round (outer step)")
    ax.set_ylabel("loss")
    ax.set_title("DiLoCo: train loss per peer and held-out eval loss per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(peers: list[dict[str, Any]]) -> str:
    """The closing table: one line per peer."""
    header = (f"{'peer':<14}{'rounds':>7}{'eval loss':>11}{'compute s':>11}{'comm s':>9}{'MB sent':>9}"
              "  final global sha256")
    lines = [header, "-" * len(header)]
    for p in peers:
        evals = [e for e in p["eval_loss"] if e is not None]
        lines.append(f"{p.get('name', p['peer_id'])[:13]:<14}{p['rounds_completed']:>7}"
                     f"{(f'{evals[-1]:.4f}' if evals else '-'):>11}{p['compute_s']:>11.1f}{p['comm_s']:>9.2f}"
                     f"{p['bytes_sent'] / 1e6:>9.2f}  {(p['final_global_sha256'] or '-')[:16]}")
    return "\n".join(lines)
