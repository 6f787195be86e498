"""Compute utilization of a real swarm: per peer, seconds in inner steps / training wall seconds, on loopback
and with every peer in its own network namespace behind a tbf-shaped link, per H and per compression, next to
the round model's prediction

    utilization ~ H t_step / (H t_step + t_matchmaking + t_allreduce),  t_allreduce ~ 2(n-1)/n bytes / bandwidth

with t_step measured in the same run, 2(n-1)/n bytes = the bytes a peer sent per round (bench/traffic.py checks
them against the bound), and t_matchmaking = the comm seconds per round of the loopback run of the same
(H, compression), where bandwidth costs nothing.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.common import md_table, stamp, tiny_config
from bench.swarmrun import netns_available, run_swarm, utilization

FULL = dict(peers=4, links=[None, "100mbit", "20mbit"], points=[(10, "none"), (10, "int8"), (50, "none")])
QUICK = dict(peers=2, links=[None, "20mbit"], points=[(10, "none")])


def rate_bits(link: str) -> float:
    return float(link.rstrip("mbit")) * 1e6


def run(quick: bool) -> dict:
    spec = QUICK if quick else FULL
    n = spec["peers"]
    ok, why = netns_available()
    links = spec["links"] if ok else [None]
    note = "" if ok else f"\n\nNetwork namespaces are not available here ({why}): loopback only."
    runs, rows, mm = [], [], {}
    with tempfile.TemporaryDirectory(prefix="bench-util-") as tmp:
        for link in links:
            for h, comp in spec["points"]:
                steps = 30 if quick else max(100, 3 * h)
                cfg = tiny_config(steps, h, swarm={"run_id": f"bench-util-{int(time.time())}", "compression": comp})
                cfg.diloco.eval_every = cfg.diloco.rounds  # one eval, at the end: the loop is inner steps + rounds
                result = run_swarm(cfg, n, Path(tmp) / f"{link or 'lo'}-h{h}-{comp}", rate=link)
                peers = [utilization(p) for p in result["peers"] if p["rounds"]]
                if not peers:
                    rows.append([link or "loopback", h, comp, "failed", "", "", "", "", ""])
                    runs.append(dict(link=link, H=h, compression=comp, failed=result["failed"]))
                    continue
                tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
                t_step = statistics.mean(p["compute_s"] / (p["tokens"] / tokens_per_step) for p in peers)
                comm = statistics.mean(p["comm_s_per_round"] for p in peers)
                sent = statistics.mean(p["bytes_sent_per_round"] for p in peers)
                if link is None:
                    mm[(h, comp)] = comm
                t_mm = mm.get((h, comp), 0.0)
                t_ar = 0.0 if link is None else sent * 8 / rate_bits(link)
                predicted = h * t_step / (h * t_step + t_mm + t_ar)
                utils = [p["utilization"] for p in peers]
                runs.append(dict(link=link, H=h, compression=comp, steps=steps, peers=peers, t_step=t_step,
                                 comm_s_per_round=comm, bytes_sent_per_round=sent, t_matchmaking=t_mm,
                                 t_allreduce_model=t_ar, predicted=predicted, failed=result["failed"],
                                 swarm_wall_s=result["wall_s"], shaped_bytes=result["shaped_bytes"],
                                 round_records=[p["rounds"] for p in result["peers"]]))
                if link and sum(result["shaped_bytes"].values()) < len(peers) * sent:
                    raise RuntimeError(f"{link}: the traffic did not go through the shaped links")
                rows.append([link or "loopback", h, comp, f"{statistics.mean(utils):.1%}",
                             f"{min(utils):.1%}–{max(utils):.1%}", f"{predicted:.1%}", f"{t_step * 1e3:.0f}",
                             f"{comm:.2f}", f"{t_mm:.2f} + {t_ar:.2f}"])
                print(f"  utilization: {link or 'loopback'} H={h} {comp}: {statistics.mean(utils):.1%} "
                      f"(model {predicted:.1%})", flush=True)
    table = md_table(["link", "H", "compression", "utilization (mean)", "min–max over peers", "round model",
                      "t_step ms", "comm s / round", "model: t_mm + t_allreduce s"], rows)
    table += (f"\n\n{n} peers + a bootstrap, each its own process (1 torch thread) on 2 shared cores; shaped links: "
              f"every process in its own network namespace, tbf on both directions of its veth. Utilization "
              f"excludes start-up; the model's t_mm is the loopback run's comm time per round.{note}")
    return {"table": table, "config": {"peers": n, "links": links, "points": spec["points"], "netns": ok,
                                       "netns_note": why}, "runs": runs, "timestamp": stamp()}
