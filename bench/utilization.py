"""Compute utilization of a real swarm: per peer, seconds in inner steps / training wall seconds, on loopback
and with every peer in its own network namespace behind a tbf-shaped link, per H and per compression, next to
the round model's prediction

    utilization ~ H t_step / (H t_step + max(0, t_matchmaking + t_allreduce - delay t_step) + t_other),
    t_allreduce ~ 2(n-1)/n bytes / bandwidth

with t_step measured in the same run, 2(n-1)/n bytes = the bytes a peer sent per round (bench/traffic.py checks
them against the bound), and t_matchmaking = the comm seconds per round of the loopback run of the same
(H, compression), where bandwidth costs nothing. With `diloco.delay` the exchange runs behind the next round's
first `delay` inner steps, and only what they do not hide stops the compute. t_other (outer step, hashing, the
exchange's launch) is measured per round. Reported for the steady state (rounds 2 to R-1) and the whole run.

The closed form assumes peers of one steady speed. Four peers sharing 2 cores are not: their rounds end up to a
second apart, and an exchange ends only after the last of them started it, so `replayed` runs the same model
over each peer's measured inner-step seconds of every round (the straggler term), with the exchange as the
loopback run of the same mode measured it (under a delay, it competes with the peers' compute for the cores).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from bench.common import md_table, stamp, tiny_config
from bench.swarmrun import netns_available, run_swarm, utilization

# Sets of runs: peers, links, and points (H, compression, diloco.delay, diloco.fragments). With a delay the
# exchange runs behind the next `delay` inner steps; with F fragments a round makes F exchanges of ~1/F of the
# bytes, each behind `delay` (< H / F) inner steps. The second full set runs 2 peers, one compute-bound process
# per core, to tell what the link costs from what 4 compute-bound peers on 2 cores cost each other.
FULL = [dict(peers=4, links=[None, "100mbit", "20mbit"],
             points=[(10, "none", 0, 1), (10, "int8", 0, 1), (50, "none", 0, 1), (10, "int8", 8, 1),
                     (50, "none", 25, 1), (10, "int8", 4, 2), (50, "none", 20, 2)]),
        dict(peers=2, links=[None, "20mbit"],
             points=[(10, "int8", 0, 1), (50, "none", 0, 1), (10, "int8", 8, 1), (50, "none", 25, 1)])]
QUICK = [dict(peers=2, links=[None, "20mbit"], points=[(10, "none", 0, 1), (10, "none", 8, 1), (10, "none", 4, 2)])]


# The round model at scale: a peer is a GPU cluster whose inner step takes t_step (the Streaming DiLoCo paper's
# simulation, arXiv 2501.18512 Table 4: 0.1 s at 1B and 0.8 s at 10B parameters at 60% MFU; 30B scaled linearly
# from 10B), 8 peers, a 1 Gbit/s link each, H = 500, wire bytes per parameter as measured by bench/compression.py
# (int8 0.27x and int4 0.16x of fp32's 4 bytes), matchmaking 1 s.
# Streaming DiLoCo columns (diloco.fragments F, diloco.delay; delay < H / F): F exchanges per round, each of 1/F
# of the bytes and its own matchmaking, each hidden behind `delay` inner steps.
SCALE = dict(peers=8, link_bits=1e9, H=500, t_mm=1.0, models=[("1B", 1e9, 0.1), ("30B", 30e9, 2.4)],
             codecs=[("int8", 4 * 0.27), ("int4", 4 * 0.16)], delays=[0, 50, 250],
             streaming=[(4, 5), (4, 50), (16, 25)])


def round_model(h: int, t_step: float, t_comm: float, delay: int, rounds: Optional[int] = None,
                fragments: int = 1, t_other: float = 0.0) -> float:
    """Compute utilization over `rounds` rounds (None: the steady state) of H inner steps each, with `fragments`
    exchanges of `t_comm` s per round: each stops the compute for whatever of it the `delay` inner steps after
    its start do not hide; the last exchange has nothing to hide behind. `t_other`: the rest of a round that is
    neither inner steps nor exchange (outer step, hashing, the exchange's launch), measured."""
    blocked = max(0.0, t_comm - delay * t_step)
    if rounds is None:
        return h * t_step / (h * t_step + fragments * blocked + t_other)
    return rounds * h * t_step / (rounds * h * t_step + (rounds * fragments - 1) * blocked + t_comm + rounds * t_other)


def replayed(compute: list[list[float]], h: int, t_comm: float, delay: int, fragments: int = 1,
             t_other: float = 0.0) -> list[float]:
    """The round model replayed over the rounds a swarm ran: `compute[i][r]`, peer i's measured inner-step
    seconds in round r, spread evenly over its H inner steps (peers of unequal and varying speed, as 4 processes
    on 2 shared cores are). Each exchange starts when a peer reaches its start step (fragment f of a round:
    after inner step (f + 1) H // F, as in swarm/train/fragments.py), ends `t_comm` after the *last* peer started it,
    and lands `delay` inner steps after its start, where a peer that gets there first waits; with delay 0 every
    peer waits for it where it started. Returns each peer's steady-state utilization (rounds 2 to R-1), the
    terms the closed-form model has no room for: waiting for the slowest peer, at every exchange."""
    n, rounds = len(compute), min(map(len, compute))
    cuts = [(f + 1) * h // fragments for f in range(fragments)]
    clock, done = [0.0] * n, [0] * n  # per peer: seconds since the run began, inner steps done
    began = [[0.0] * rounds for _ in range(n)]  # when each round's inner steps began
    lands: dict[tuple[int, int], float] = {}  # (peer, inner step over the run) -> when the exchange landing there ends
    for start in (r * h + cut for r in range(rounds) for cut in cuts):
        for i in range(n):
            while done[i] < start:
                clock[i] += compute[i][done[i] // h] / h
                done[i] += 1
                clock[i] = max(clock[i], lands.pop((i, done[i]), 0.0))
                if delay and done[i] % h == 0 and done[i] < rounds * h:
                    clock[i] += t_other
                    began[i][done[i] // h] = clock[i]
        end = max(clock) + t_comm
        for i in range(n):
            if delay:
                lands[(i, start + delay)] = end
            else:
                clock[i] = end + (t_other if start % h == 0 else 0.0)
                if start % h == 0 and start < rounds * h:
                    began[i][start // h] = clock[i]
    return [sum(compute[i][1:rounds - 1]) / (began[i][rounds - 1] - began[i][1]) for i in range(n)]


def projection() -> str:
    n, rows = SCALE["peers"], []
    for model, params, t_step in SCALE["models"]:
        for codec, bytes_per_param in SCALE["codecs"]:
            sent = 2 * (n - 1) / n * params * bytes_per_param
            t_comm = SCALE["t_mm"] + sent * 8 / SCALE["link_bits"]
            streaming = [round_model(SCALE["H"], t_step, SCALE["t_mm"] + sent / f * 8 / SCALE["link_bits"], d,
                                     fragments=f) for f, d in SCALE["streaming"]]
            rows.append([model, codec, f"{sent / 1e9:.1f}", f"{t_comm:.0f}", f"{SCALE['H'] * t_step:.0f}",
                         *[f"{round_model(SCALE['H'], t_step, t_comm, d):.1%}" for d in SCALE["delays"]],
                         *[f"{u:.1%}" for u in streaming]])
    return md_table(["model", "codec", "GB sent / peer / round", "exchange s", "H inner steps s",
                     *[f"delay {d}" for d in SCALE["delays"]],
                     *[f"F={f}, delay {d} (peak 1/{f})" for f, d in SCALE["streaming"]]], rows)


def rate_bits(link: str) -> float:
    return float(link.rstrip("mbit")) * 1e6


def run(quick: bool) -> dict:
    ok, why = netns_available()
    note = "" if ok else f"\n\nNetwork namespaces are not available here ({why}): loopback only."
    runs, rows = [], []
    blocking_comm: dict[tuple, float] = {}  # (peers, H, codec) -> comm s per round, loopback, blocking
    last_exchange: dict[tuple, float] = {}  # (peers, H, codec, delay, F) -> s per exchange, loopback, last peer
    sets = [(spec["peers"], link, point) for spec in (QUICK if quick else FULL)
            for link in (spec["links"] if ok else [None]) for point in spec["points"]]
    with tempfile.TemporaryDirectory(prefix="bench-util-") as tmp:
        for n, link, (h, comp, delay, fragments) in sets:
            steps = 30 if quick else max(200, 6 * h)
            cfg = tiny_config(steps, h, swarm={"run_id": f"bench-util-{int(time.time())}", "compression": comp},
                              diloco={"delay": delay, "fragments": fragments})
            cfg.diloco.eval_every = cfg.diloco.rounds  # one eval, at the end: the loop is inner steps + rounds
            result = run_swarm(cfg, n, Path(tmp) / f"{n}-{link or 'lo'}-h{h}-{comp}-d{delay}-f{fragments}", rate=link)
            peers = [utilization(p) for p in result["peers"] if p["rounds"]]
            if not peers:
                rows.append([n, link or "loopback", h, comp, delay, fragments, "failed", *[""] * 9])
                runs.append(dict(peers_n=n, link=link, H=h, compression=comp, delay=delay, fragments=fragments,
                                 failed=result["failed"]))
                continue
            tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
            t_step = statistics.mean(p["compute_s"] / (p["tokens"] / tokens_per_step) for p in peers)
            comm = statistics.mean(p["comm_s_per_round"] for p in peers)
            sent = statistics.mean(p["bytes_sent_per_round"] for p in peers)
            records = [p["rounds"] for p in result["peers"] if p["rounds"]]
            if link is None and not delay and fragments == 1:
                blocking_comm[(n, h, comp)] = comm
            if link is None:  # the exchange itself: the last peer to start it waits for nobody
                last = [min(r[k]["comm_s"] for r in records) for k in range(min(map(len, records)))]
                last_exchange[(n, h, comp, delay, fragments)] = statistics.mean(last) / fragments
            t_mm = blocking_comm.get((n, h, comp), 0.0)  # per exchange
            t_ar = 0.0 if link is None else sent / fragments * 8 / rate_bits(link)  # per exchange
            t_other = statistics.mean(p["overhead_s_per_round"] for p in peers)
            predicted = round_model(h, t_step, t_mm + t_ar, delay, cfg.diloco.rounds, fragments, t_other)
            steady_model = round_model(h, t_step, t_mm + t_ar, delay, fragments=fragments, t_other=t_other)
            t_exchange = last_exchange.get((n, h, comp, delay, fragments), 0.0) + t_ar
            replay = statistics.mean(replayed([[r["compute_s"] for r in rs] for rs in records], h, t_exchange,
                                              delay, fragments, t_other))
            utils = [p["utilization"] for p in peers]
            steady = [p["steady"] for p in peers]
            runs.append(dict(peers_n=n, link=link, H=h, compression=comp, delay=delay, fragments=fragments, steps=steps,
                             peers=peers,
                             t_step=t_step, comm_s_per_round=comm, bytes_sent_per_round=sent, t_matchmaking=t_mm,
                             t_allreduce_model=t_ar, t_other=t_other, predicted=predicted,
                             predicted_steady=steady_model, t_exchange=t_exchange, replayed_steady=replay,
                             failed=result["failed"],
                             swarm_wall_s=result["wall_s"], shaped_bytes=result["shaped_bytes"],
                             round_records=[p["rounds"] for p in result["peers"]]))
            if link and sum(result["shaped_bytes"].values()) < len(peers) * sent:
                raise RuntimeError(f"{link}: the traffic did not go through the shaped links")
            rows.append([n, link or "loopback", h, comp, delay, fragments, f"{statistics.mean(steady):.1%}",
                         f"{min(steady):.1%}–{max(steady):.1%}", f"{steady_model:.1%}",
                         f"{replay:.1%}",
                         f"{statistics.mean(utils):.1%}", f"{predicted:.1%}", f"{t_step * 1e3:.0f}",
                         f"{comm:.2f}", f"{t_mm:.2f} + {t_ar:.2f}", f"{t_other:.2f}"])
            print(f"  utilization: {n} peers, {link or 'loopback'} H={h} {comp} delay {delay} F={fragments}: steady "
                  f"{statistics.mean(steady):.1%} (model {steady_model:.1%}, replayed {replay:.1%}), whole run "
                  f"{statistics.mean(utils):.1%} (model {predicted:.1%})", flush=True)
    table = md_table(["peers", "link", "H", "compression", "delay", "fragments", "steady state (mean)",
                      "min–max over peers", "round model", "round model replayed", "whole run (mean)",
                      "round model, whole run", "t_step ms", "comm s / round", "model: t_mm + t_allreduce s",
                      "t_other s"], rows)
    table += (f"\n\nThe peers + a bootstrap, each its own process (1 torch thread) on 2 shared cores (4 peers: two "
              f"compute-bound processes per core; 2 peers: one); shaped links: "
              f"every process in its own network namespace, tbf on both directions of its veth. Steady state: "
              f"inner-step seconds / wall seconds from the start of round 2 to the start of the last round, as in "
              f"a long run; whole run: from the start of round 1 to the end of the last (its exchange, which "
              f"nothing hides, and the final eval included). The model's t_mm is the loopback run's comm time per "
              f"round (blocking), with a delay the exchange hides behind that many inner steps (except the last), "
              f"with F fragments a round makes F exchanges of t_mm + t_allreduce / F each, "
              f"and t_other is the rest of a round outside inner steps and exchange, measured "
              f"(round records' overhead_s less eval_s). The round model assumes peers of equal, steady speed; "
              f"replayed, it runs over each peer's measured inner-step seconds per round (`replayed`): an "
              f"exchange ends t_exchange after the last peer started it, t_exchange = the loopback run's exchange "
              f"in the same mode (delay, fragments) as its last peer to start it saw it, + t_allreduce.{note}"
              f"\n\nThe round model projected "
              f"to GPU-cluster peers ({SCALE['peers']} peers, 1 Gbit/s links, H={SCALE['H']}; t_step 0.1 s at 1B and "
              f"2.4 s at 30B, from the Streaming DiLoCo paper's simulation; measured wire bytes per codec):\n\n"
              f"{projection()}")
    return {"table": table, "config": {"sets": QUICK if quick else FULL, "netns": ok, "netns_note": why},
            "runs": runs, "timestamp": stamp()}
