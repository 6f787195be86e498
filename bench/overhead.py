"""Overhead: tokens/s of one `swarm peer --solo` (the real CLI, in its own process) against a plain PyTorch loop
(AdamW, same schedule, clipping) on the same model and the same batches (shard 0), both on 1 torch thread,
measured alternately in one run. Two ratios: the inner loop (the peer's own compute_s, i.e. the trainer's
per-step overhead) and end to end (the whole process wall time, start-up, evals and the outer steps included).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import REPO, md_table, stamp, tiny_config, train_plain, write_config


def solo(cfg, tmp: Path, i: int) -> dict:
    out = tmp / f"solo-{i}"
    path = write_config(cfg, tmp / "solo.yaml")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "swarm.cli", "peer", "--solo", "--config", str(path), "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=1200)
    wall = time.perf_counter() - start
    peer = json.loads((out / "summary.json").read_text())["peers"][0]
    return {"compute_s": peer["compute_s"], "process_wall_s": wall}


def run(quick: bool) -> dict:
    steps, h, repeats = (60, 30, 1) if quick else (200, 50, 3)
    cfg = tiny_config(steps, h)
    cfg.diloco.eval_every = cfg.diloco.rounds  # evals are not training: one at the end, as a user would
    tokens = steps * cfg.data.batch_size * cfg.data.seq_len
    torch.set_num_threads(1)
    plain, solos = [], []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for i in range(repeats):  # alternate, so load from elsewhere on the machine hits both alike
            plain.append(train_plain(cfg, [0], steps, eval_points=0)[1])
            solos.append(solo(cfg, Path(tmp), i))
    plain_tps = tokens / min(plain)
    inner_tps = tokens / min(s["compute_s"] for s in solos)
    e2e_tps = tokens / min(s["process_wall_s"] for s in solos)
    rows = [["plain PyTorch loop", f"{plain_tps:,.0f}", "1.000"],
            ["swarm peer --solo, inner loop (compute_s)", f"{inner_tps:,.0f}", f"{inner_tps / plain_tps:.3f}"],
            ["swarm peer --solo, whole process", f"{e2e_tps:,.0f}", f"{e2e_tps / plain_tps:.3f}"]]
    table = md_table(["what", "tokens/s", "ratio to plain"], rows)
    table += (f"\n\n{steps} steps of {cfg.data.batch_size}x{cfg.data.seq_len} tokens (H={h}, "
              f"{cfg.diloco.rounds} rounds, one eval at the end), 1 torch thread, best of {repeats} alternated runs.")
    return {"table": table, "config": {"steps": steps, "inner_steps": h, "repeats": repeats, "base": cfg.to_dict()},
            "plain_s": plain, "solo": solos, "tokens": tokens, "timestamp": stamp()}
