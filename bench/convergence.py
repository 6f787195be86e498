"""Convergence, the shape of the DiLoCo paper's Table 2, at tiny scale on CPU.

At equal inner steps per worker: one worker (batch B, shard 0); synchronous data parallel over M workers
(the M workers' batches of each step averaged into one M x B step: one all-reduce per step); DiLoCo with M
workers through the project's own loop (`peers.local_trainers.simulate`, M replicas on shards 0..M-1, the
same data as data parallel) over a grid of H and outer lr; and one point repeated as a real local swarm
(`swarm local`, M processes over loopback) that must land on the same held-out eval loss.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import REPO, md_table, results_dir, stamp, tiny_config, train_plain, write_config
from peers.local_trainers import simulate
from swarm.data.batches import load_corpus
from swarm.train.model import build_model, count_parameters

M = 4
# DiLoCo points: (H, outer lr[, diloco.delay[, diloco.fragments, diloco.mix_alpha]]): the outer step lands `delay`
# inner steps after its exchange started, the exchange running behind them (swarm/train/overlap.py); with F fragments
# F exchanges of 1/F of the parameters each are staggered across the round (Streaming DiLoCo, swarm/train/fragments.py)
FULL = dict(steps=400, grid=[(10, 0.3), (10, 0.7), (25, 0.7), (50, 0.5), (50, 0.7), (50, 1.0), (100, 1.0),
                             (10, 0.3, 5), (50, 0.7, 5), (50, 0.7, 25),
                             (50, 0.7, 5, 2, 0.0), (50, 0.7, 5, 2, 0.5), (50, 0.7, 5, 4, 0.5)],
            swarm_point=(50, 0.7), long=(1600, [(50, 0.7), (50, 0.7, 5), (50, 0.7, 25), (50, 0.7, 5, 2, 0.5)]))
QUICK = dict(steps=60, grid=[(10, 0.3), (30, 0.7), (30, 0.7, 5), (30, 0.7, 5, 2, 0.5)], swarm_point=(30, 0.7))


def unpack(point: tuple) -> tuple[int, float, int, int, float]:
    """(H, outer lr, delay, fragments, mix_alpha) of a grid point, with the defaults it leaves out."""
    return tuple(point) + (0, 1, 0.0)[len(point) - 2:]


def method(delay: int, fragments: int = 1, alpha: float = 0.0) -> str:
    if fragments > 1:
        return f"Streaming DiLoCo, F={fragments}, delay {delay}, alpha {alpha:g}"
    return f"DiLoCo, delay {delay}" if delay else "DiLoCo"


def overlap_fields(delay: int, fragments: int, alpha: float, steps: int, h: int) -> dict:
    """A point's overlap settings and its exchanges per worker (F per round, each of 1/F of the parameters)."""
    return dict(delay=delay, fragments=fragments, mix_alpha=alpha, allreduces=steps // h * fragments)


def diloco_sim(steps: int, h: int, olr: float, tmp: Path, delay: int = 0, fragments: int = 1,
               alpha: float = 0.0) -> tuple[list[tuple[int, float]], float]:
    cfg = tiny_config(steps, h, olr, diloco={"delay": delay, "fragments": fragments, "mix_alpha": alpha})
    start = time.perf_counter()
    trainers = simulate(cfg, M, tmp / f"sim-h{h}-olr{olr}-d{delay}-f{fragments}-a{alpha}")
    hist = trainers[0].progress.history
    curve = [(0, hist.initial_eval_loss)] + [(r.round * h, r.eval_loss) for r in hist.rounds
                                             if r.committed and r.eval_loss is not None]
    return curve, time.perf_counter() - start


def diloco_swarm(steps: int, h: int, olr: float, tmp: Path, swarm: dict | None = None, tag: str = "") -> dict:
    """The same point as a real `swarm local` run: M processes over loopback. As in the sim, every peer runs all
    H inner steps: the straggler early stop is off (swarm.progress_interval huge, so records must outlive it too)
    and a leader waits up to 60 s for the whole group (on 2 shared cores a peer can fall more than the default
    5 s behind). `swarm`: more swarm keys (bench/quantized.py: the compression); `tag`: names its folder."""
    cfg = tiny_config(steps, h, olr, swarm={"run_id": f"bench-conv-{int(time.time())}", "progress_interval": 1e6,
                                            "progress_expiration": 1e7, "matchmaking_time": 60.0,
                                            # the sim's sample-weighted mean (the defaults bound influence)
                                            "max_weight_share": 1.0, "clip_norm_ratio": 0.0, "aggregation": "mean",
                                            "compression": "none",  # the sim's exact exchange
                                            **(swarm or {})})
    out = tmp / f"swarm-h{h}-olr{olr}{tag}"
    path = write_config(cfg, tmp / "swarm.yaml")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "swarm.cli", "local", "--config", str(path), "--peers", str(M),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": f"swarm local exited {proc.returncode}: {proc.stderr.strip()[-500:]}", "wall_s": wall}
    summary = json.loads((out / "summary.json").read_text())
    peers = summary["peers"]
    finals = [[e for e in p["eval_loss"] if e is not None][-1] for p in peers]
    return {"eval_loss": finals[0], "eval_loss_per_peer": finals, "wall_s": wall,
            "identical_globals": len({p["final_global_sha256"] for p in peers}) == 1,
            "rounds": [p["rounds_completed"] for p in peers],
            "samples_per_round": [r["samples"] for r in peers[0]["rounds"]]}


def long_points(steps: int, grid: list[tuple[int, float]], tmp: Path) -> tuple[list[dict], str]:
    """Where DiLoCo needs more rounds to pay off: single worker vs DiLoCo at `steps` per worker (no DP: too slow)."""
    cfg = tiny_config(steps, steps)
    curve, secs = train_plain(cfg, [0], steps)
    points = [dict(method="single worker", label=f"single (B), {steps} steps", H=None, outer_lr=None, curve=curve,
                   seconds=secs, allreduces=0, steps=steps)]
    for h, olr, *overlap in map(unpack, grid):
        curve, secs = diloco_sim(steps, h, olr, tmp, *overlap)
        points.append(dict(method=method(*overlap), label=f"{method(*overlap)} H={h} olr={olr}, {steps} steps", H=h,
                           outer_lr=olr, curve=curve, seconds=secs, steps=steps,
                           **overlap_fields(*overlap, steps, h)))
    single = points[0]["curve"][-1][1]
    rows = [[p["method"], p["H"] or "–", p["outer_lr"], steps, f"{p['curve'][-1][1]:.4f}",
             f"{p['curve'][-1][1] - single:+.3f}", p["allreduces"], f"{p['seconds']:.0f}"] for p in points]
    return points, md_table(["method", "H", "outer lr", "steps / worker", "eval loss", "vs single", "exchanges",
                             "wall s"], rows)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for p in points:
        if p.get("curve"):
            steps, losses = zip(*p["curve"])
            style = "--" if p["method"].startswith("DiLoCo") else "-"
            ax.plot(steps, losses, style, marker=".", label=p["label"], linewidth=2 if style == "-" else 1)
    ax.set_xlabel("inner steps per worker")
    ax.set_ylabel("held-out eval loss")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title(f"tiny Llama, {M} workers: single vs data parallel vs DiLoCo (H, outer lr)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(quick: bool) -> dict:
    spec = QUICK if quick else FULL
    steps = spec["steps"]
    cfg = tiny_config(steps, steps)
    params = count_parameters(build_model(cfg.model, load_corpus(cfg.data).tokenizer.vocab_size))
    torch.set_num_threads(1)  # as every sim replica and swarm peer; 2 threads on 2 busy cores are slower
    points = []
    curve, secs = train_plain(cfg, [0], steps)
    points.append(dict(method="single worker", label="single (B)", H=None, outer_lr=None, curve=curve, seconds=secs,
                       allreduces=0))
    curve, secs = train_plain(cfg, list(range(M)), steps)
    points.append(dict(method=f"data parallel x{M}", label=f"DP ({M}xB)", H=1, outer_lr=None, curve=curve,
                       seconds=secs, allreduces=steps))
    with tempfile.TemporaryDirectory(prefix="bench-conv-") as tmp:
        for h, olr, *overlap in map(unpack, spec["grid"]):
            curve, secs = diloco_sim(steps, h, olr, Path(tmp), *overlap)
            points.append(dict(method=method(*overlap), label=f"{method(*overlap)} H={h} olr={olr}", H=h,
                               outer_lr=olr, curve=curve, seconds=secs, **overlap_fields(*overlap, steps, h)))
            print(f"  convergence: {method(*overlap)} H={h} olr={olr}: eval {curve[-1][1]:.4f} ({secs:.0f}s)",
                  flush=True)
        h, olr = spec["swarm_point"]
        swarm = diloco_swarm(steps, h, olr, Path(tmp))
        long, long_table = long_points(*spec["long"], Path(tmp)) if "long" in spec else ([], "")
    sim_point = next(p for p in points if p["H"] == h and p["outer_lr"] == olr and not p.get("delay")
                     and p.get("fragments", 1) == 1)
    swarm.update(H=h, outer_lr=olr, sim_eval_loss=sim_point["curve"][-1][1])
    if "eval_loss" in swarm:
        swarm["abs_diff"] = abs(swarm["eval_loss"] - swarm["sim_eval_loss"])

    dp_loss = points[1]["curve"][-1][1]
    single_loss = points[0]["curve"][-1][1]
    rows = []
    for p in points:
        final = p["curve"][-1][1]
        p["eval_loss"] = final
        rounds = p["allreduces"] // p.get("fragments", 1)  # each round's exchanges carry the parameters once
        rows.append([p["method"], p["H"] if p["H"] is not None else "–", p["outer_lr"], f"{final:.4f}",
                     f"{final - single_loss:+.3f}", f"{final - dp_loss:+.3f}", p["allreduces"],
                     f"{rounds * params:.3g}", f"{steps / rounds:.0f}x" if rounds else "–", f"{p['seconds']:.0f}"])
    if "eval_loss" in swarm:
        rows.append([f"DiLoCo, real swarm ({M} processes)", h, olr, f"{swarm['eval_loss']:.4f}",
                     f"{swarm['eval_loss'] - single_loss:+.3f}", f"{swarm['eval_loss'] - dp_loss:+.3f}", steps // h,
                     f"{steps // h * params:.3g}", f"{h}x", f"{swarm['wall_s']:.0f}"])
    table = md_table(["method", "H", "outer lr", "eval loss", "vs single", "vs DP", "exchanges",
                      "floats all-reduced / worker", "less comm. than DP", "wall s"], rows)
    agree = (f"sim vs swarm at H={h}, olr={olr}: {swarm['sim_eval_loss']:.4f} vs {swarm['eval_loss']:.4f} "
             f"(|diff| {swarm['abs_diff']:.4f}), final globals identical on every peer: {swarm['identical_globals']}"
             if "eval_loss" in swarm else f"real swarm point failed: {swarm.get('error')}")
    best = min((p for p in points if p["method"].startswith("DiLoCo")), key=lambda p: p["eval_loss"])
    results_dir(quick).mkdir(parents=True, exist_ok=True)
    plot(points + long, results_dir(quick) / "convergence.png")
    table += (f"\n\n{params / 1e6:.2f}M-parameter Llama, {M} workers, batch {cfg.data.batch_size}x{cfg.data.seq_len} "
              f"per worker, {steps} inner steps per worker, inner AdamW lr {cfg.inner.lr}. "
              f"Best DiLoCo: {best['label']} at {best['eval_loss']:.4f}. {agree}. \"delay τ\": the exchange "
              f"runs behind the next round's first τ inner steps, whose end its outer step waits for (diloco.delay). "
              f"Streaming DiLoCo F: F exchanges per round of 1/F of the parameters each, staggered across the round, "
              f"each landing τ inner steps after it started; alpha: diloco.mix_alpha. Plot: convergence.png")
    if long_table:
        table += f"\n\nLonger runs (more rounds), same settings otherwise:\n\n{long_table}"
    return {"table": table, "config": {"steps": steps, "workers": M, "params": params, "grid": spec["grid"],
                                       "swarm_point": spec["swarm_point"], "long": spec.get("long"),
                                       "base": cfg.to_dict()},
            "points": points, "swarm": swarm, "long": long, "timestamp": stamp()}
