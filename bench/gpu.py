"""On one GPU: the 150M recipe (configs/llama-150m.yaml: bf16 autocast, micro-batches of 32 x 1024 tokens)
as a user runs it, next to the loop anyone would write in plain PyTorch on the same model, and two peers of it
sharing the GPU with the shipped exchange settings (`diloco.delay auto`, `swarm.compression` as shipped).

Three measurements, in one process that runs the CLI as a user would:
- plain: AdamW (fused) with the trainer's schedule and clipping, bf16 autocast, the same micro-batches, the
  same batches (shard 0 of the recipe's data); tokens/s over the steps after a warm-up, peak GPU memory.
- solo: `swarm peer --solo`, blocking rounds; its inner loop's tokens/s (compute_s), the seconds of a round
  outside inner steps (`overhead_s`: outer step, hashing, eval), peak GPU memory (`peak_device_bytes`).
- pair: `swarm local --peers 2` on the same GPU, the recipe's own delay; the all-reduce's MB/s per peer
  (bytes received / allreduce_s), the seconds a round waited for its exchange, and peak GPU memory per peer.

Only on a machine with CUDA (bench/run.py skips it elsewhere and keeps the committed results). The batch is
cut from the recipe's 512 to 128 sequences so that the whole bench ends in a few minutes; the per-token figures
do not depend on it (the micro-batch is the recipe's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from bench.common import REPO, commit, md_table, stamp
from swarm.data.batches import TrainBatches, load_corpus
from swarm.run.configfile import load_config
from swarm.train.inner import lr_lambda
from swarm.train.model import build_model

NEEDS_CUDA = True
RECIPE = REPO / "configs" / "llama-150m.yaml"
BATCH, WARMUP = 128, 3
TOY_DATA = {"source": "embedded", "tokenizer": "bytes", "dataset": None, "dataset_config": None}
"""The GPU box has no C4 (nothing downloads there): the recipe's model and step on the embedded corpus's bytes,
which is the throughput and memory of the step, whatever the tokens."""
SHRUNK = ["--data.batch_size", str(BATCH), "--inner.warmup_steps", "10", "--checkpoint.every", "0",
          "--logging.progress_bar", "false", "--data.source", "embedded", "--data.tokenizer", "bytes",
          "--data.dataset", "null", "--data.dataset_config", "null"]


def plain(steps: int) -> dict:
    cfg = load_config(RECIPE, {"data": {"batch_size": BATCH, **TOY_DATA}})
    corpus = load_corpus(cfg.data)
    batches = TrainBatches(corpus, cfg.data, 0)
    model = build_model(cfg.model, corpus.tokenizer.vocab_size, cfg.data.tokenizer).to("cuda")
    inner = cfg.inner
    opt = torch.optim.AdamW(model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2), eps=inner.eps,
                            weight_decay=inner.weight_decay, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(inner, steps))
    torch.cuda.reset_peak_memory_stats()
    start = 0.0
    for step in range(steps):
        if step == WARMUP:
            torch.cuda.synchronize()
            start = time.perf_counter()
        batch = batches.batch(step).to("cuda")
        parts = batch.split(inner.micro_batch_size or len(batch))
        for part in parts:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=part, labels=part).loss / len(parts)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # what the trainer does each step (its progress line): one sync
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": (steps - WARMUP) * BATCH * cfg.data.seq_len / seconds,
            "peak_device_bytes": torch.cuda.max_memory_allocated(),
            "params": sum(p.numel() for p in model.parameters())}


def swarm(args: list[str], out: Path, timeout: float) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "swarm.cli", *args, "--config", str(RECIPE), *SHRUNK,
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        logs = "".join(f"\n--- {p.relative_to(out)}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                       for p in sorted([*out.glob("*.log"), *out.glob("*/log.txt")]))
        raise RuntimeError(f"swarm {args[0]} exited {done.returncode}: {done.stderr.strip()[-1500:]}{logs}")
    summary = json.loads((out / "summary.json").read_text())
    summary["process_wall_s"] = time.perf_counter() - start
    return summary


def steady(rounds: list[dict]) -> list[dict]:
    """The committed rounds after the first (which pays for compilation and the allocator's warm-up)."""
    committed = [r for r in rounds if r["committed"]]
    return committed[1:] or committed


def run(quick: bool) -> dict:
    steps, h, rounds = (8, 5, 2) if quick else (25, 20, 3)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        base = plain(steps)
        solo = swarm(["peer", "--solo", "--diloco.inner_steps", str(h), "--diloco.rounds", str(rounds),
                      "--diloco.delay", "0"], Path(tmp) / "solo", timeout=900)
        try:
            pair, pair_error = swarm(["local", "--peers", "2", "--diloco.inner_steps", str(h), "--diloco.rounds",
                                      str(rounds)], Path(tmp) / "pair", timeout=900), None
        except RuntimeError as e:  # the single-peer figures stand without it
            pair, pair_error = {"peers": [], "config": solo["config"]}, str(e)
    device = f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return report(base, solo["peers"][0], pair, pair_error, steps, h, rounds, device)


def report(base: dict, peer: dict, pair: dict, pair_error: Optional[str], steps: int, h: int, rounds: int,
           device: str, note: str = "") -> dict:
    """The tables and the raw figures of one run on `device`: `base` from `plain`, `peer` the solo peer's summary,
    `pair` the 2-peer swarm's summary.json (its `peers` empty if it failed, `pair_error` saying why)."""
    gib = 2 ** 30
    solo_rounds = steady(peer["rounds"])
    inner_tps = sum(r["tokens_per_s"] * r["compute_s"] for r in solo_rounds) / sum(r["compute_s"] for r in solo_rounds)
    rows = [["plain PyTorch (fused AdamW)", f"{base['tokens_per_s']:,.0f}", "1.000", "-",
             f"{base['peak_device_bytes'] / gib:.1f}"],
            ["swarm peer --solo, inner loop", f"{inner_tps:,.0f}", f"{inner_tps / base['tokens_per_s']:.3f}",
             f"{sum(r['overhead_s'] for r in solo_rounds) / len(solo_rounds):.2f} "
             f"(eval {sum(r['eval_s'] for r in solo_rounds) / len(solo_rounds):.2f})",
             f"{peer['peak_device_bytes'] / gib:.1f}"]]
    pair_rows = []
    for p in pair["peers"]:
        rs = [r for r in steady(p["rounds"]) if r["allreduce_s"] > 0]
        received, seconds = sum(r["bytes_received"] for r in rs), sum(r["allreduce_s"] for r in rs)
        pair_rows.append([p["peer_id"][:12], f"{received / max(seconds, 1e-9) / 1e6:,.0f}",
                          f"{sum(r['wait_s'] for r in rs) / max(len(rs), 1):.2f}",
                          f"{sum(r['overhead_s'] for r in rs) / max(len(rs), 1):.2f}",
                          f"{p['peak_device_bytes'] / gib:.1f}", p["final_global_sha256"][:12]])
    cfg = pair["config"]
    table = md_table(["what", "tokens/s", "ratio to plain", "s per round outside inner steps", "peak GPU GiB"], rows)
    if pair_error:
        pair_rows.append([f"failed: {pair_error.splitlines()[0][:300]}", "-", "-", "-", "-", "-"])
    table += "\n\n" + md_table(["2 peers on one GPU: peer", "all-reduce MB/s received", "s waited per round",
                                "s outside inner steps and exchange", "peak GPU GiB", "final hash"], pair_rows)
    table += (f"\n\nMeasured at commit {commit()} on {device}: "
              f"{base['params'] / 1e6:.0f}M parameters, batch {BATCH} x {cfg['data']['seq_len']} tokens in "
              f"micro-batches of {cfg['inner']['micro_batch_size']}, bf16 autocast; plain: {steps} steps, the first "
              f"{WARMUP} untimed; solo: {rounds} blocking rounds of H={h}; pair: {rounds} rounds of H={h}, "
              f"diloco.delay {cfg['diloco']['delay']}, swarm.compression {cfg['swarm']['compression']}; rounds "
              f"after the first (compilation, allocator warm-up). Both peers of the pair share the GPU, so each "
              f"trains at about half speed.{note}")
    return {"table": table, "plain": base, "solo": {k: v for k, v in peer.items() if k != "events"},
            "pair": [{k: v for k, v in p.items() if k != "events"} for p in pair["peers"]], "pair_error": pair_error,
            "timestamp": stamp()}
